from __future__ import annotations

import subprocess
import sys

HEAVY = ["torch", "vllm", "nixl", "nixl_cu13", "numpy", "transformers", "zmq"]


def run_py(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_help_lists_the_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "--help"], check=True, capture_output=True, text=True
    ).stdout
    for command in ("model", "bench", "demo"):
        assert command in out


def test_cli_imports_nothing_heavy():
    code = (
        "import sys, kvpush.cli as c; c.build_parser().format_help();"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert run_py(code) == "[]"


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
