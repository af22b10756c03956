"""Start-up refusals name the setting (no engine: vLLM's config objects are stood in for by
namespaces with the same attributes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.launch.engine import FIRST_TOKEN_PROCESSOR
from kvpush.transfer.staging import resolve_staging_bytes
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.firsttoken import FQCN, FirstTokenProcessor


def vllm_config(
    role="kv_producer",
    pp=1,
    mla=False,
    hybrid=False,
    extra=None,
    engine_id="p0",
    procs=(FQCN,),
    device="cuda",
):
    kv = SimpleNamespace(kv_role=role, engine_id=engine_id, kv_connector_extra_config=extra or {})
    return SimpleNamespace(
        kv_transfer_config=kv,
        device_config=SimpleNamespace(device_type=device),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        model_config=SimpleNamespace(
            use_mla=mla, is_hybrid=hybrid, model="m", logits_processors=list(procs)
        ),
    )


def test_defaults():
    c = ConnectorConfig.from_vllm(vllm_config())
    assert c.is_prefill and c.side_channel_port == 5600 and c.lease_s == 30.0
    assert c.backends == ("UCX",) and c.dead_after_s == 5.0
    assert ConnectorConfig.from_vllm(vllm_config("kv_consumer")).side_channel_port == 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"pp": 2}, "pipeline parallel yet \\(pipeline_parallel_size=2\\)"),
        ({"mla": True}, "MLA"),
        ({"hybrid": True}, "hybrid attention/state-space"),
        ({"role": "kv_both"}, "got 'kv_both'"),
        ({"engine_id": ""}, "needs an engine_id"),
        (
            {"extra": {"side_chanel_port": 1}},
            "object contains unknown field `side_chanel_port`",
        ),
        (
            {"role": "kv_consumer", "procs": ()},
            "--logits-processors kvpush.vllm.firsttoken:FirstTokenProcessor",
        ),
    ],
)
def test_unsupported_set_ups_are_refused_naming_the_setting(kw, message):
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_vllm(vllm_config(**kw))


def test_gil_switch_interval_defaults_and_refuses_a_bad_value():
    assert ConnectorConfig.from_vllm(vllm_config()).gil_switch_interval_s is None  # GPU
    assert ConnectorConfig.from_vllm(vllm_config(device="cpu")).gil_switch_interval_s == 0.0002
    cfg = ConnectorConfig.from_vllm(vllm_config(extra={"gil_switch_interval_s": 0.001}))
    assert cfg.gil_switch_interval_s == 0.001
    with pytest.raises(
        ValueError, match="extra_config.gil_switch_interval_s: expected `float` > 0.0"
    ):
        ConnectorConfig.from_vllm(vllm_config(extra={"gil_switch_interval_s": 0}))


def test_idle_wait_defaults_to_2_ms_on_cpu_engines_only_and_takes_a_setting_anywhere():
    assert ConnectorConfig.from_vllm(vllm_config()).idle_wait_s == 0  # GPU: never measured
    assert ConnectorConfig.from_vllm(vllm_config(device="cpu")).idle_wait_s == 0.002
    cfg = ConnectorConfig.from_vllm(vllm_config(extra={"idle_wait_s": 0.004}))
    assert cfg.idle_wait_s == 0.004
    off = ConnectorConfig.from_vllm(vllm_config(device="cpu", extra={"idle_wait_s": 0}))
    assert off.idle_wait_s == 0
    with pytest.raises(ValueError, match="extra_config.idle_wait_s: expected `float` <= 0.05"):
        ConnectorConfig.from_vllm(vllm_config(extra={"idle_wait_s": 0.1}))


def test_fast_poll_defaults_turns_off_with_0_and_refuses_the_busy_step_or_more():
    assert ConnectorConfig.from_vllm(vllm_config()).fast_poll_s == 0.0001
    assert ConnectorConfig.from_vllm(vllm_config(extra={"fast_poll_s": 0})).fast_poll_s == 0
    with pytest.raises(ValueError, match="extra_config.fast_poll_s: expected `float` < 0.001"):
        ConnectorConfig.from_vllm(vllm_config(extra={"fast_poll_s": 0.001}))


def test_the_removed_endpoint_nice_is_refused_by_name_with_the_known_settings():
    with pytest.raises(ValueError, match="unknown field `endpoint_nice` .known: backends"):
        ConnectorConfig.from_vllm(vllm_config(extra={"endpoint_nice": 10}))


def test_staging_defaults_to_the_memory_kind_and_refuses_negative_sizes():
    cfg = ConnectorConfig.from_vllm(vllm_config())
    assert (cfg.staging_mib, cfg.staging_min_descs) == (None, 512)  # None: 1 GiB on VRAM only
    assert resolve_staging_bytes(None, "VRAM") == 1 << 30
    assert resolve_staging_bytes(None, "DRAM") == 0
    assert ConnectorConfig.from_vllm(vllm_config(extra={"staging_mib": 0})).staging_mib == 0
    with pytest.raises(ValueError, match="extra_config.staging_mib: expected `int` >= 0"):
        ConnectorConfig.from_vllm(vllm_config(extra={"staging_mib": -1}))
    with pytest.raises(ValueError, match="extra_config.staging_min_descs: expected `int` >= 1"):
        ConnectorConfig.from_vllm(vllm_config(extra={"staging_min_descs": 0}))


@pytest.mark.parametrize(
    "extra, on", [({}, True), ({"early_source": "auto"}, True), ({"early_source": False}, False)]
)
def test_early_source_is_on_by_default_and_auto_still_means_on(extra, on):
    assert ConnectorConfig.from_vllm(vllm_config(extra=extra)).early_source is on
    with pytest.raises(ValueError, match="extra_config.early_source"):
        ConnectorConfig.from_vllm(vllm_config(extra={"early_source": "sometimes"}))


def test_decode_accepts_the_first_token_processor_by_name_or_class():
    assert FIRST_TOKEN_PROCESSOR == FQCN  # what kvpush serve passes is what the check wants
    for procs in ((FQCN,), (FirstTokenProcessor,), ("other:Proc", FQCN)):
        assert not ConnectorConfig.from_vllm(vllm_config("kv_consumer", procs=procs)).is_prefill


@pytest.mark.parametrize(
    "device, extra, on",
    [
        ("cuda", {}, True),
        ("cpu", {}, False),  # vLLM's CPU forward ends before the workers get the Prepare
        ("cpu", {"prepare_ahead": "auto"}, False),
        ("cpu", {"prepare_ahead": True}, True),
        ("cuda", {"prepare_ahead": False}, False),
    ],
)
def test_prepare_ahead_is_on_where_the_engine_computes_on_a_gpu(device, extra, on):
    cfg = ConnectorConfig.from_vllm(vllm_config(extra=extra, device=device))
    assert cfg.prepare_ahead is on
    with pytest.raises(ValueError, match="extra_config.prepare_ahead"):
        ConnectorConfig.from_vllm(vllm_config(extra={"prepare_ahead": "sometimes"}))


@pytest.mark.parametrize(
    "device, extra, on",
    [
        ("cuda", {}, True),
        ("cpu", {}, False),  # on one-core engines the layers' WRITEs slow the forward
        ("cpu", {"layerwise": True}, True),
        ("cuda", {"layerwise": False}, False),
    ],
)
def test_layerwise_is_on_where_the_engine_computes_on_a_gpu(device, extra, on):
    assert ConnectorConfig.from_vllm(vllm_config(extra=extra, device=device)).layerwise is on
    with pytest.raises(ValueError, match="extra_config.layerwise"):
        ConnectorConfig.from_vllm(vllm_config(extra={"layerwise": "sometimes"}))
