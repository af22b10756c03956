"""Figures and summary.md from a fixture results folder (no engines)."""

from __future__ import annotations

import json

import pytest

from kvpush.bench import plot
from kvpush.bench.serve import result_name
from kvpush.bench.slo import SloConfig


def write_point(folder, mode, qps, n_in, it, ttft, tpot):
    data = {
        "mode": mode,
        "qps": qps,
        "input_len": n_in,
        "output_len": 16,
        "iteration": it,
        "median_ttft_ms": ttft,
        "median_tpot_ms": tpot,
        "mean_ttft_ms": ttft,
        "mean_tpot_ms": tpot,
        "p99_ttft_ms": ttft,
        "p99_tpot_ms": tpot,
        "hardware": {"cpus": 2, "machine": "x86_64", "platform": "test"},
    }
    (folder / result_name(mode, qps, n_in, 16, it)).write_text(json.dumps(data))


def test_plot_writes_figures_and_a_summary_with_ratios(tmp_path):
    for it in range(2):
        for qps in (1.0, 4.0):
            for n_in in (256, 1024):
                write_point(tmp_path, "kvpush", qps, n_in, it, 100.0 + it * 10, 10.0)
                write_point(tmp_path, "nixl-pull", qps, n_in, it, 200.0 + it * 10, 40.0)
    assert plot.main(tmp_path, "median") == 0
    assert (tmp_path / "ttft_median.png").stat().st_size > 1000
    assert (tmp_path / "tpot_p99.png").exists()
    summary = (tmp_path / "summary.md").read_text()
    assert "| QPS | input | output | kvpush ms | nixl-pull ms | kvpush/nixl-pull |" in summary
    assert "| 1 | 256 | 16 | 105.0 | 205.0 | 0.51 |" in summary  # averaged over iterations
    assert "| 4 | 1024 | 16 | 10.0 | 40.0 | 0.25 |" in summary


def test_plot_names_the_expected_file_pattern_when_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="_qps<q>_in<in>_out<out>_iter<i>.json"):
        plot.load(tmp_path)


def test_the_ttft_breakdown_is_drawn_only_from_results_with_the_proxy_phases(tmp_path):
    write_point(tmp_path, "mono", 1.0, 256, 0, 50.0, 5.0)
    assert plot.breakdown(plot.load(tmp_path), tmp_path) is None
    path = tmp_path / result_name("kvpush", 1.0, 256, 16, 0)
    write_point(tmp_path, "kvpush", 1.0, 256, 0, 100.0, 10.0)
    data = json.loads(path.read_text())
    data["proxy_phases_ms"] = {p: {"median": 10.0, "p99": 20.0} for p in plot.BREAKDOWN}
    path.write_text(json.dumps(data))
    out = plot.breakdown(plot.load(tmp_path), tmp_path)
    assert out == tmp_path / "ttft_breakdown.png" and out.stat().st_size > 1000


def test_results_without_kvpushs_fields_take_the_grid_point_from_their_name(tmp_path):
    """As `vllm bench serve` writes them for anyone: vLLM's fields only."""
    for mode, ttft in (("push", 50.0), ("pull", 200.0)):
        data = {"median_ttft_ms": ttft, "median_tpot_ms": 5.0, "p99_ttft_ms": ttft}
        (tmp_path / result_name(mode, 8.0, 16384, 128, 0)).write_text(json.dumps(data))
    (tmp_path / "unrelated_qpsx_in_out_iter.json").write_text("{}")  # not the pattern: skipped
    assert set(plot.load(tmp_path)) == {("push", 8.0, 16384, 128), ("pull", 8.0, 16384, 128)}
    assert plot.main(tmp_path) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| 8 | 16384 | 128 | 50.0 | 200.0 | 0.25 |" in summary  # push/pull


def test_the_summary_sets_both_ways_into_kvpush_against_the_others_and_each_other(tmp_path):
    for mode, ttft in (("kvpush", 30.0), ("kvpush-front-end", 27.0), ("mono", 25.0)):
        write_point(tmp_path, mode, 1.0, 256, 0, ttft, 5.0)
    assert plot.main(tmp_path, "median") == 0
    summary = (tmp_path / "summary.md").read_text()
    head = ("| QPS | input | output | kvpush ms | kvpush-front-end ms | mono ms | kvpush/mono "
            "| kvpush-front-end/mono | kvpush-front-end/kvpush |")  # fmt: skip
    assert head in summary
    assert "| 1 | 256 | 16 | 30.0 | 27.0 | 25.0 | 1.20 | 1.08 | 0.90 |" in summary


def detailed(ttft_ms: list[float], tpot_ms: float, n_out: int = 16) -> dict:
    """vLLM's per-request fields (`--save-detailed`) for requests with these TTFTs."""
    return {
        "ttfts": [t / 1e3 for t in ttft_ms],
        "latencies": [(t + tpot_ms * (n_out - 1)) / 1e3 for t in ttft_ms],
        "output_lens": [n_out] * len(ttft_ms),
        "errors": [""] * len(ttft_ms),
    }


def test_slo_attainment_from_foreign_vllm_json_is_drawn_and_summarised(tmp_path):
    """JSON as anyone's own `vllm bench serve --save-detailed` writes it, with no targets of
    its own: the targets come from `kvpush plot --slo-*`; the summary gives each stack's share
    per point and the highest QPS up to which >= 90 % meet both."""
    shape = {  # mode -> QPS -> TTFTs of its 10 requests
        "push": {1.0: [100] * 10, 2.0: [100] * 9 + [900], 4.0: [100] * 8 + [900] * 2},
        "pull": {1.0: [100] * 10, 2.0: [900] * 5 + [100] * 5, 4.0: [100] * 10},
    }
    for mode, by_qps in shape.items():
        for qps, ttfts in by_qps.items():
            data = {"median_ttft_ms": 100.0, "median_tpot_ms": 5.0} | detailed(ttfts, 5.0)
            (tmp_path / result_name(mode, qps, 1024, 16, 0)).write_text(json.dumps(data))
    slo = SloConfig(ttft_ms=500, tpot_ms=8)
    assert plot.attainment_figure(plot.load(tmp_path), None, tmp_path) is None  # no targets
    assert plot.main(tmp_path, "median", slo) == 0
    assert (tmp_path / "slo_attainment.png").stat().st_size > 1000
    summary = (tmp_path / "summary.md").read_text()
    assert "## SLO attainment (% of requests with TTFT <= 500 ms and TPOT <= 8 ms)" in summary
    assert "| 2 | 1024 | 16 | 90 | 50 |" in summary
    assert "| 4 | 1024 | 16 | 80 | 100 |" in summary
    # pull meets it again at 4 QPS, but not at every rate up to it
    assert "- input 1024, output 16: push 2, pull 1" in summary


def test_results_run_with_targets_are_judged_by_their_own(tmp_path):
    """Results that carry their targets are judged by them; goodput is the share that met
    them times the rate requests completed at."""
    for mode, tpot, ttfts in (("kvpush", 5.0, [100] * 4), ("replicas", 9.0, [100] * 4),
                              ("mono", 5.0, [100, 100, 900, 900])):  # fmt: skip
        data = detailed(ttfts, tpot) | {"mode": mode, "qps": 1.0, "input_len": 256,
                                        "output_len": 16, "median_ttft_ms": 100.0,
                                        "request_throughput": 0.9,
                                        "slo": {"ttft_ms": 500, "tpot_ms": 8}}  # fmt: skip
        (tmp_path / result_name(mode, 1.0, 256, 16, 0)).write_text(json.dumps(data))
    assert plot.main(tmp_path) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| 1 | 256 | 16 | 100 | 50 | 0 |" in summary
    head = "| QPS | input | output | kvpush req/s | mono req/s | replicas req/s | kvpush/mono |"
    assert head in summary
    assert "| 1 | 256 | 16 | 0.90 | 0.45 | 0.00 | 2.00 | - |" in summary  # none meet: no ratio
    assert "- input 256, output 16: kvpush 1, mono none, replicas none" in summary
