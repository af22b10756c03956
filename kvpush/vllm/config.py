"""The connector's settings, read once from vLLM's kv-transfer-config and checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_SIDE_CHANNEL_PORT = 5600  # prefill rank r listens on this + r

DEFAULT_GIL_SWITCH_INTERVAL_S = 0.0002  # see ConnectorConfig.gil_switch_interval_s


@dataclass(frozen=True)
class ConnectorConfig:
    engine_id: str
    is_prefill: bool
    backends: tuple[str, ...]
    side_channel_host: str
    side_channel_port: int  # prefill: base port; decode: 0 picks a free one
    lease_s: float
    dead_after_s: float
    heartbeat_s: float
    debug_checksum: bool
    # sys.setswitchinterval in the worker process: how long the endpoint thread can wait for
    # the GIL while vLLM's worker spin-waits for its next step (Python's default is 5 ms;
    # 0.2 ms measured in docs/benchmarks.md, "The push tail")
    gil_switch_interval_s: float = DEFAULT_GIL_SWITCH_INTERVAL_S
    # tests only: a request's kv_transfer_params may name a connector hook to raise in
    # ("kvpush_debug_fault"; kvpush.vllm.scheduler.PushScheduler.inject)
    debug_faults: bool = False

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        kv = vllm_config.kv_transfer_config
        roles = {"kv_producer": True, "kv_consumer": False}
        if kv.kv_role not in roles:
            raise ValueError(
                f"KVPushConnector needs kv_role 'kv_producer' (prefill) or 'kv_consumer' "
                f"(decode), got {kv.kv_role!r}"
            )
        if not kv.engine_id:
            raise ValueError("KVPushConnector needs an engine_id in --kv-transfer-config")
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "KVPushConnector does not support pipeline parallel yet "
                f"(pipeline_parallel_size={parallel.pipeline_parallel_size}); use 1"
            )
        model = vllm_config.model_config
        if model.use_mla:
            raise ValueError(f"KVPushConnector does not support MLA models yet ({model.model})")
        if model.is_hybrid:
            raise ValueError(
                f"KVPushConnector does not support hybrid attention/state-space models yet "
                f"({model.model})"
            )
        if kv.kv_role == "kv_consumer":
            from kvpush.vllm import firsttoken

            if not firsttoken.is_loaded(model):
                raise ValueError(
                    "KVPushConnector on a decode engine (kv_consumer) continues from the first "
                    "token prefill sampled, which the proxy has already sent to the client: "
                    f"start vLLM with --logits-processors {firsttoken.FQCN} "
                    "(kvpush serve does)"
                )
        extra = dict(kv.kv_connector_extra_config or {})
        known = {
            "backends",
            "side_channel_host",
            "side_channel_port",
            "lease_s",
            "dead_after_s",
            "heartbeat_s",
            "debug_checksum",
            "gil_switch_interval_s",
            "debug_faults",
        }
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        is_prefill = roles[kv.kv_role]
        default_port = DEFAULT_SIDE_CHANNEL_PORT if is_prefill else 0
        return cls(
            engine_id=kv.engine_id,
            is_prefill=is_prefill,
            backends=tuple(extra.get("backends", ["UCX"])),
            side_channel_host=str(extra.get("side_channel_host", "127.0.0.1")),
            side_channel_port=int(extra.get("side_channel_port", default_port)),
            lease_s=float(extra.get("lease_s", 30.0)),
            dead_after_s=float(extra.get("dead_after_s", 5.0)),
            heartbeat_s=float(extra.get("heartbeat_s", 1.0)),
            debug_checksum=bool(extra.get("debug_checksum", False)),
            debug_faults=bool(extra.get("debug_faults", False)),
            gil_switch_interval_s=_positive(
                extra, "gil_switch_interval_s", DEFAULT_GIL_SWITCH_INTERVAL_S
            ),
        )


def _positive(extra: dict, name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"kv_connector_extra_config {name} must be a number > 0, got {value!r}")
    return float(value)
