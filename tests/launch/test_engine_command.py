"""The engine command `kvpush serve` runs on CPU: the whole process tree pinned to the role's
cores by default (docs/benchmarks.md, capacity), which `--no-pin-cores` turns off."""

from __future__ import annotations

from dataclasses import replace

from kvpush.cli import build_parser
from kvpush.launch.engine import EngineSpec
from kvpush.launch.stack import spec_from_args

SPEC = EngineSpec("decode", "m", 8200, engine_id="d0")  # this host has no GPU: CPU defaults


def test_cpu_engines_run_their_whole_tree_on_their_cores():
    assert SPEC.command()[:3] == ["taskset", "-c", "1"]
    assert replace(SPEC, tp_size=2, cpu_bind="0|1").command()[:3] == ["taskset", "-c", "0,1"]
    assert "taskset" not in replace(SPEC, pin_cores=False).command()


def test_serve_pins_by_default_and_no_pin_cores_turns_it_off(tmp_path):
    parser = build_parser()
    base = ["serve", "--role", "prefill", "--model", str(tmp_path)]
    assert spec_from_args(parser.parse_args(base)).pin_cores
    assert not spec_from_args(parser.parse_args([*base, "--no-pin-cores"])).pin_cores
