"""The `ray` extra stays optional (kvpush.ray): kvpush imports and `kvpush ray up` says what to
install without Ray, or with a Ray other than the tested one; and the app's configuration
(kvpush.ray.app), which needs no Ray. The app itself runs in tests/ray (`make test-ray`)."""

from __future__ import annotations

import sys
import types

import pytest

from kvpush.cli import main
from kvpush.ray import RAY_VERSION, RayUnavailable, check_ray
from kvpush.ray.app import RayStack, cpu_binds, llm_config


def test_without_ray_kvpush_ray_up_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayUnavailable, match=r"pip install 'kvpush\[ray\]'"):
        check_ray()
    assert main(["ray", "up"]) == 2
    assert f"ray[serve]=={RAY_VERSION}" in capsys.readouterr().err


def test_another_ray_version_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(__version__="2.99.0"))
    with pytest.raises(RayUnavailable, match=r"tested with Ray 2\.60\.0, found 2\.99\.0"):
        check_ray()


def test_each_role_gets_kvpushs_connector_and_on_cpu_a_core_and_one_logical_cpu():
    stack = RayStack("/models/tiny", num_prefill=2, num_decode=1, max_decode=3)
    prefill, decode = llm_config(stack, "prefill"), llm_config(stack, "decode")
    for config, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        kv = config["engine_kwargs"]["kv_transfer_config"]
        assert kv["kv_connector"] == "KVPushConnector" and kv["kv_role"] == role
        assert config["placement_group_config"] == {"bundles": [{"CPU": 1}]}
    assert decode["engine_kwargs"]["kv_transfer_config"]["kv_load_failure_policy"] == "recompute"
    assert prefill["deployment_config"] == {"num_replicas": 2}
    assert decode["deployment_config"]["autoscaling_config"] == {
        "min_replicas": 1, "initial_replicas": 1, "max_replicas": 3,
    }  # fmt: skip
    assert stack.num_cpus == 2 * (2 + 3) + 1
    on_gpu = llm_config(RayStack("m", on_cpu=False), "decode")
    assert "placement_group_config" not in on_gpu and "runtime_env" not in on_gpu


def test_cpu_replicas_spread_over_the_cores_prefill_from_the_first_decode_from_the_last():
    assert cpu_binds("prefill", 2, 2) == ["0", "1"] and cpu_binds("decode", 1, 2) == ["1"]
    assert cpu_binds("decode", 3, 2) == ["1", "0", "1"]


@pytest.mark.parametrize(
    "bad", [{"num_prefill": 0}, {"num_decode": 2, "max_decode": 1}], ids=["none", "max"]
)
def test_a_stack_with_no_replica_or_a_bound_below_its_count_is_refused(bad):
    with pytest.raises(ValueError):
        RayStack("m", **bad)
