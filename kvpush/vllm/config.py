"""The connector's settings, read once from vLLM's kv-transfer-config and checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from kvpush.vllm.params import validation_error

if TYPE_CHECKING:  # vLLM's types, for the checker only
    from vllm.config import VllmConfig

DEFAULT_SIDE_CHANNEL_PORT = 5600  # prefill rank r listens on this + r

CPU_GIL_SWITCH_INTERVAL_S = 0.0002  # see ConnectorConfig.gil_switch_interval_s
DEFAULT_FAST_POLL_S = 0.0001  # see ConnectorConfig.fast_poll_s
CPU_IDLE_WAIT_S = 0.002  # see ConnectorConfig.idle_wait_s


Seconds = Annotated[float, msgspec.Meta(gt=0)]


class ExtraConfig(msgspec.Struct, forbid_unknown_fields=True):
    """kv_connector_extra_config as written in --kv-transfer-config (ConnectorConfig's
    fields, documented there)."""

    backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    side_channel_host: str = "127.0.0.1"
    side_channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    lease_s: Seconds = 30.0
    dead_after_s: Seconds = 5.0
    heartbeat_s: Seconds = 1.0
    debug_checksum: bool = False
    gil_switch_interval_s: Seconds | None = None
    fast_poll_s: Annotated[float, msgspec.Meta(ge=0, lt=0.001)] = DEFAULT_FAST_POLL_S
    early_source: bool | Literal["auto"] = True
    prepare_ahead: bool | Literal["auto"] = "auto"
    layerwise: bool | Literal["auto"] = "auto"
    idle_wait_s: Annotated[float, msgspec.Meta(ge=0, le=0.05)] | None = None
    staging_mib: Annotated[int, msgspec.Meta(ge=0)] | None = None
    staging_min_descs: Annotated[int, msgspec.Meta(ge=1)] = 512
    debug_faults: bool = False


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
    # the GIL while vLLM's worker runs Python (Python's default is 5 ms). None leaves the
    # process's own. Unset, it is 0.2 ms where the engine computes on the CPU, where it was
    # measured (`git show 1df146f:docs/benchmarks.md`, "The push tail"), and None on a GPU,
    # where it never was: a process-wide setting is not changed on a guess
    gil_switch_interval_s: float | None = None
    # the endpoint loop's poll step for a few ms after each WRITE is posted (prefill) or
    # announced (decode); 0 keeps the 1 ms busy step (transfer.endpoint.TransferConfig)
    fast_poll_s: float = DEFAULT_FAST_POLL_S
    # prefill: the scheduler sends SOURCE to its own ranks when vLLM finishes a request,
    # so the push starts without waiting for the next engine step (kvpush.vllm.scheduler).
    # On by default everywhere since 2026-12-05: on one-core engines it no longer delays the
    # API server's answer (`git show 1df146f:docs/benchmarks.md`, "Made ready ahead on this
    # host"). "auto", the default before (off on one-core engines), is still accepted and
    # now means on
    early_source: bool = True
    # prefill: when vLLM schedules a request's last prompt tokens, the workers make its
    # push's WRITE to each registered decode rank ready (copy plan, NIXL transfer) while the
    # engine computes them, so that the push only posts it (PrefillEndpoint.prepare).
    # "auto" (the default): on where the engine runs on a GPU. vLLM hands a step's connector
    # metadata to the workers after the forward is launched; on a GPU that is while the
    # kernels run, on CPU the forward is synchronous, so the WRITE would be made ready only
    # after the compute, holding the worker's main thread (docs/design/transfer.md, "Made ready
    # ahead")
    prepare_ahead: bool = True
    # prefill: a request whose last prompt tokens this step computes is written to each
    # registered decode rank layer by layer, each layer's WRITE posted as soon as vLLM's
    # forward has computed it (save_kv_layer), so that the push itself writes only the last
    # layer (PrefillEndpoint.computed; docs/design/transfer.md, "Layer by layer"). "auto" (the
    # default): on where the engine runs on a GPU
    layerwise: bool = True
    # a step that schedules no tokens, while this worker has a transfer in flight: the
    # worker waits (in wait_for_save) until one completes, at most this long, instead of
    # returning at once to an engine loop that would step again at once; 0: no wait.
    # A request that arrives meanwhile waits at most this long (docs/architecture.md,
    # "Idle steps"). Unset: 2 ms where the engine computes on the CPU (its cores shared with
    # the transfer's thread), where it was measured (docs/benchmarks.md, "The knobs kept"),
    # and 0 on a GPU, where it never was
    idle_wait_s: float = 0.0
    # staging area per worker for scattered pushes (kvpush.transfer.staging), in MiB: None
    # is 1024 where the KV cache is in VRAM (outside vLLM's gpu_memory_utilization budget)
    # and none on DRAM; 0 turns staging off. A push is staged when its copy plan would post
    # at least staging_min_descs descriptors and both sides have a slot free
    staging_mib: int | None = None
    staging_min_descs: int = 512
    # tests only: a request's kv_transfer_params may name a connector hook to raise in
    # ("kvpush_debug_fault"; kvpush.vllm.scheduler.PushScheduler.inject)
    debug_faults: bool = False

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorConfig:
        kv = vllm_config.kv_transfer_config
        if kv is None:
            raise ValueError("KVPushConnector needs --kv-transfer-config")
        roles = {"kv_producer": True, "kv_consumer": False}
        if kv.kv_role is None or kv.kv_role not in roles:
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
        extra = read_extra(dict(kv.kv_connector_extra_config or {}))
        is_prefill = roles[kv.kv_role]
        port = extra.side_channel_port
        if port is None:
            port = DEFAULT_SIDE_CHANNEL_PORT if is_prefill else 0
        fields = msgspec.structs.asdict(extra) | {
            "backends": tuple(extra.backends),
            "side_channel_port": port,
            "early_source": extra.early_source in (True, "auto"),
            "prepare_ahead": _on_gpu(vllm_config)
            if extra.prepare_ahead == "auto"
            else extra.prepare_ahead,
            "layerwise": _on_gpu(vllm_config) if extra.layerwise == "auto" else extra.layerwise,
        }
        if extra.gil_switch_interval_s is None and not _on_gpu(vllm_config):
            fields["gil_switch_interval_s"] = CPU_GIL_SWITCH_INTERVAL_S
        if extra.idle_wait_s is None:
            fields["idle_wait_s"] = 0.0 if _on_gpu(vllm_config) else CPU_IDLE_WAIT_S
        return cls(engine_id=kv.engine_id, is_prefill=is_prefill, **fields)


def read_extra(raw: dict) -> ExtraConfig:
    """kv_connector_extra_config checked; a ValueError names the setting at fault (and, for
    an unknown one, the known ones)."""
    try:
        return msgspec.convert(raw, ExtraConfig)
    except msgspec.ValidationError as e:
        message = validation_error(e, "kv_connector_extra_config")
        if "unknown field" in message:
            message += f" (known: {', '.join(ExtraConfig.__struct_fields__)})"
        raise ValueError(message) from None


def _on_gpu(vllm_config: VllmConfig) -> bool:
    """Whether the engine computes on an accelerator (its forward returns before the compute
    ends), not on the CPU."""
    return vllm_config.device_config.device_type != "cpu"
