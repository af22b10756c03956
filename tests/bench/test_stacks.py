"""The stacks `kvpush bench serve` compares get the same hardware."""

from __future__ import annotations

from kvpush.bench.stacks import baseline_specs, describe, disaggregated_specs, mode_stack


def test_mono_gets_all_the_cores_and_kv_cache_of_the_disaggregated_stack():
    ours = disaggregated_specs("m", "kvpush", pin_cores=True, in_process=None)
    (mono,) = baseline_specs("mono", "m", pin_cores=True, in_process=False)
    assert {c for s in ours for c in s.cpu_cores.split(",")} == set(mono.cpu_cores.split(","))
    assert mono.kv_cache_gib == sum(s.kv_cache_gib for s in ours)
    assert mono.connector is None and mono.kv_transfer_config() is None
    assert mono.executor_in_process  # the mode's executor, whatever the flag said
    assert mono.env()["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    (mp,) = baseline_specs("mono-mp", "m", pin_cores=True, in_process=True)
    assert not mp.executor_in_process and mp.cpu_cores == mono.cpu_cores


def test_replicas_are_one_plain_engine_per_engine_each_on_its_share():
    ours = disaggregated_specs("m", "kvpush")
    replicas = baseline_specs("replicas", "m", connector_extra={"x": 1})
    assert [r.cpu_cores for r in replicas] == [s.cpu_cores for s in ours]
    assert [r.kv_cache_gib for r in replicas] == [s.kv_cache_gib for s in ours]
    assert len({r.port for r in replicas}) == len(replicas)
    assert all(r.connector is None and r.executor_in_process for r in replicas)


def test_the_replicas_stack_puts_the_round_robin_front_before_its_engines(tmp_path):
    stack = mode_stack("replicas", "m", tmp_path)
    assert stack.proxy_cmd[1:3] == ["-m", "kvpush.bench.roundrobin"]
    assert stack.proxy_cmd[-2:] == [s.url for s in stack.specs]
    assert mode_stack("mono", "m", tmp_path).url == stack.specs[0].url  # no front
    ran = describe(stack)
    assert {e["cores"] for e in ran.values()} == {"0", "1"}
    assert {e["executor"] for e in ran.values()} == {"in-process"}
    assert all(e["prefix_caching"] for e in ran.values())
    kvpush = describe(mode_stack("kvpush", "m", tmp_path))
    assert [e["prefix_caching"] for e in kvpush.values()] == [True, True]  # decode too
