"""The engine command `kvpush serve` runs on CPU: the whole process tree pinned to the role's
cores, and vLLM's in-process executor at TP 1 (docs/benchmarks.md, capacity); both can be
turned off, and a user's own vLLM arguments come last, so they win."""

from __future__ import annotations

from dataclasses import replace

from kvpush.cli import build_parser
from kvpush.launch.engine import EngineSpec
from kvpush.launch.stack import spec_from_args

SPEC = EngineSpec("decode", "m", 8200, engine_id="d0")  # this host has no GPU: CPU defaults


def test_cpu_defaults_pin_the_tree_and_run_the_worker_in_process():
    cmd = SPEC.command()
    assert cmd[:3] == ["taskset", "-c", "1"]
    i = cmd.index("--distributed-executor-backend")
    assert cmd[i + 1] == "uni"


def test_unpinned_and_user_arguments_after_the_defaults():
    cmd = replace(
        SPEC, pin_cores=False, extra_args=("--distributed-executor-backend=mp",)
    ).command()
    assert "taskset" not in cmd
    assert cmd[-1] == "--distributed-executor-backend=mp"
    assert cmd.index("--distributed-executor-backend") < len(cmd) - 1


def test_tp2_keeps_vllms_multiprocess_executor():
    cmd = replace(SPEC, tp_size=2, cpu_bind="0|1").command()
    assert "--distributed-executor-backend" not in cmd
    assert cmd[:3] == ["taskset", "-c", "0,1"]


def test_serve_pins_by_default_and_no_pin_cores_turns_it_off(tmp_path):
    parser = build_parser()
    base = ["serve", "--role", "prefill", "--model", str(tmp_path)]
    assert spec_from_args(parser.parse_args(base)).pin_cores
    assert not spec_from_args(parser.parse_args([*base, "--no-pin-cores"])).pin_cores
