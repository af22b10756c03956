from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest

HEAVY = ["torch", "vllm", "nixl", "nixl_cu13", "numpy", "transformers", "zmq"]


def run_py(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.mark.parametrize("module", ["kvpush.cli", "kvpush"])
def test_help_lists_the_subcommands(module):
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], check=True, capture_output=True, text=True
    ).stdout
    for command in ("model", "bench", "demo"):
        assert command in out


def test_cli_imports_nothing_heavy():
    code = (
        "import sys, kvpush.cli as c; c.build_parser().format_help();"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert run_py(code) == "[]"


def test_connector_settings_are_checked_without_importing_vllm():
    """`--connector-extra` is parsed at once; vLLM loads the connector from the same package."""
    code = (
        "import sys, kvpush.cli as c;"
        "c.build_parser().parse_args(['up', '--connector-extra', '{\"fast_poll_s\": 0}']);"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    assert run_py(code) == "[]"
    code = "import kvpush.vllm as v; print(v.KVPushConnector.__module__)"
    assert run_py(code) == "kvpush.vllm.connector"


def test_transfer_engine_does_not_import_vllm_or_torch():
    code = (
        "import sys, kvpush.transfer.writer, kvpush.transfer.receiver;"
        "print(sorted(m for m in ('vllm', 'torch', 'fastapi') if m in sys.modules))"
    )
    assert run_py(code) == "[]"


def test_unknown_subcommand_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "frobnicate"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "invalid choice: 'frobnicate'" in proc.stderr


def test_bench_serve_refuses_bad_input_before_starting_anything(tmp_path):
    """No stack is started and no results folder is made for a bad grid or a bare --url."""
    cases = [
        (["--qps", "1,fast"], "--qps must be comma-separated numbers, got '1,fast'"),
        (["--input-lens", "0"], "--input-lens must be numbers > 0, got '0'"),
        (["--url", "http://127.0.0.1:9"], "--url needs --mode NAME"),
        (["--connectors", "kvpush,magic"], "unknown connectors ['magic']"),
        (["--num-prompts", "0"], "--num-prompts, --iterations and --rounds must be >= 1"),
        (["--rounds", "0"], "--num-prompts, --iterations and --rounds must be >= 1"),
        (["--connector-extra", "{fast"], "argument --connector-extra: not JSON"),
    ]
    for args, message in cases:
        out = tmp_path / "results"
        proc = subprocess.run(
            [sys.executable, "-m", "kvpush.cli", "bench", "serve", "--results-dir", str(out),
             *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, proc.stderr
        assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--connector-extra", "{fast"], "argument --connector-extra: not JSON"),
        (["--connector-extra", "[1]"], "argument --connector-extra: must be a JSON object"),
        (
            ["--connector-extra", '{"prepare_ahaed": true}'],
            "unknown field `prepare_ahaed` (known: backends,",
        ),
        (
            ["--connector-extra", '{"fast_poll_s": "soon"}'],
            "kv_connector_extra_config.fast_poll_s",
        ),
        (
            ["--connector", "nixl-pull", "--connector-extra", '{"fast_poll_s": 0}'],
            "--connector-extra sets kvpush's own engines; --connector nixl-pull has none",
        ),
    ],
)
def test_up_refuses_bad_connector_settings_before_starting_anything(tmp_path, args, message):
    """Checked against kvpush's own settings before any engine starts: the state file a
    started stack writes is never made."""
    env = os.environ | {"KVPUSH_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "up", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
    assert message in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []


def _parsers(parser: argparse.ArgumentParser, name: str = "kvpush"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_option_that_takes_a_value_names_its_default_in_help():
    """What a user leaves out is named in `--help` (the proxy's from ProxyConfig)."""
    from kvpush.cli import build_parser
    from kvpush.proxy.config import ProxyConfig

    missing = []
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            on_off = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
            if not action.option_strings or on_off or action.help is None:
                continue
            help_text = parser._get_formatter()._expand_help(action)
            proxy_default = (
                name == "kvpush proxy" and action.dest in ProxyConfig.__dataclass_fields__
            )
            has_default = action.default not in (None, [], "", math.inf) or proxy_default
            if has_default and "default" not in help_text:
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing
