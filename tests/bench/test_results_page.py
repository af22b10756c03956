"""docs/benchmarks.md quotes the committed results, and nothing else is kept: its serving
tables are `kvpush plot`'s summary of the committed JSON, line for line, and every entry of
benchmarks/results/ is named on the page."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.bench import plot

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
SERVING = ("ways_cpu", "connectors_cpu")  # the serving sets whose tables the page quotes


@pytest.mark.parametrize("name", SERVING)
def test_the_pages_serving_tables_are_the_summary_of_the_committed_json(name):
    summary = plot.summary(plot.load(RESULTS / name), "median")
    quoted = [line for line in summary.splitlines() if line.startswith(("|", "- input"))]
    assert len(quoted) > 10
    page = PAGE.read_text()
    missing = [line for line in quoted if line not in page]
    assert not missing, f"lines of {name}'s summary not on the page: {missing}"
    assert (RESULTS / name / "summary.md").read_text() == summary  # committed as plotted


def test_every_kept_result_is_quoted_on_the_page_and_the_page_is_short():
    page = PAGE.read_text()
    kept = [p for p in RESULTS.iterdir() if p.name != "README.md"]
    assert kept
    unquoted = [p.name for p in kept if f"benchmarks/results/{p.name}" not in page]
    assert not unquoted, f"kept but not quoted on docs/benchmarks.md: {unquoted}"
    assert len(page.splitlines()) <= 400


TABLES = (  # what benchmarks/scripts/results_tables.py prints the page's other tables from
    "transfer_cpu.json",
    "proxy_cpu.json",
    "gpu/transfer_h200_run10.json",
    "gpu/transfer_h100_run12.json",
    "layerwise_gpu/run1.json",
    "layerwise_gpu/run2.json",
)


@pytest.mark.parametrize("name", TABLES)
def test_the_pages_transfer_proxy_and_layer_tables_come_from_the_committed_json(name):
    import json
    import runpy

    script = runpy.run_path(str(ROOT / "benchmarks" / "scripts" / "results_tables.py"))
    printed = script["table"](json.loads((RESULTS / name).read_text()))
    rows = [line for line in printed.splitlines() if line.startswith("|")]
    assert len(rows) >= 3
    missing = [line for line in rows if line not in PAGE.read_text()]
    assert not missing, f"rows of {name}'s table not on the page: {missing}"


def test_the_pages_fast_poll_table_comes_from_the_committed_transfer_runs():
    import json
    import runpy

    script = runpy.run_path(str(ROOT / "benchmarks" / "scripts" / "results_tables.py"))
    runs = ("transfer_cpu.json", "gpu/transfer_h200_run10.json", "gpu/transfer_h100_run12.json")
    datas = [json.loads((RESULTS / name).read_text()) for name in runs]
    rows = [line for line in script["fast_poll_table"](datas).splitlines()]
    assert len(rows) == 5
    missing = [line for line in rows if line not in PAGE.read_text()]
    assert not missing, f"rows of the fast_poll_s table not on the page: {missing}"


@pytest.mark.parametrize(
    ("table", "folder", "num_rows"),
    [
        ("knobs_table", "knobs_cpu", 8),  # three settings at two rates
        ("prefix_table", "prefix_cpu", 6),  # two stacks at two rates
        ("paths_table", "ways_cpu", 7),  # five rates
    ],
)
def test_the_pages_tables_of_result_folders_come_from_the_committed_runs(table, folder, num_rows):
    import runpy

    script = runpy.run_path(str(ROOT / "benchmarks" / "scripts" / "results_tables.py"))
    rows = script[table](str(RESULTS / folder)).splitlines()
    assert len(rows) == num_rows
    missing = [line for line in rows if line not in PAGE.read_text()]
    assert not missing, f"rows of the {table} of {folder} not on the page: {missing}"


def test_the_pages_soak_table_comes_from_the_committed_runs():
    import runpy

    script = runpy.run_path(str(ROOT / "benchmarks" / "scripts" / "results_tables.py"))
    runs = ("chaos_cpu", "overload_kv_bound_cpu", "overload_cpu")
    rows = script["chaos_table"](*(str(RESULTS / run) for run in runs))
    assert len(rows.splitlines()) == 5
    missing = [line for line in rows.splitlines() if line not in PAGE.read_text()]
    assert not missing, f"rows of the soak table not on the page: {missing}"
