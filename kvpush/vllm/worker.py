"""The connector's worker half: owns the transfer endpoint of one vLLM worker (TP rank).

Every hook returns at once: actions become calls that only enqueue work on the endpoint's
own thread, and results are collected from futures that are already done.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

from kvpush.transfer import wire
from kvpush.transfer.agent import Agent
from kvpush.transfer.endpoint import AgentFactory, TransferConfig
from kvpush.vllm import firsttoken
from kvpush.vllm import metadata as m
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.kvlayout import layer_regions, layout_from_kv_caches
from kvpush.vllm.stats import GAUGES, KVPushStats

if TYPE_CHECKING:  # vLLM's types, for the checker only
    import torch
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


# The engines' timeline phases: (from mark, to mark), on one host's monotonic clock. Prefill:
# vLLM finished the request -> the writer has it -> first WRITE posted (this includes waiting
# for decode's registration) -> last WRITE complete -> reported to vLLM as finished sending;
# "next_step" is the part of handover until the worker got the push (the next engine step);
# "head_start" how long before that the scheduler's SOURCE had started it (only then);
# "ready_ahead" how long before the hand-over its WRITE was made ready (prepare_ahead);
# "layers_ahead" how long before it the first layer was written (layerwise).
# Decode: vLLM allocated the blocks -> REGISTER sent -> every WRITE in -> reported to vLLM as
# finished receiving; "land" is the part of wait_writes after prefill announced its first
# WRITE (POSTED); "scatter" the part after a staged WRITE landed in its slot (staging.py).
PHASES = {
    "handover": ("finished", "handed"),
    "next_step": ("finished", "started"),
    "head_start": ("sourced", "started"),
    "ready_ahead": ("readied", "handed"),
    "layers_ahead": ("layered", "handed"),
    "pair_and_post": ("handed", "posted"),
    "write": ("posted", "written"),
    "release": ("written", "reported"),
    "register": ("expected", "registered"),
    "wait_writes": ("registered", "notified"),
    "land": ("announced", "notified"),
    "scatter": ("landed", "notified"),
    "report": ("notified", "reported"),
}


def timeline_phases(marks: dict[str, float]) -> dict[str, float]:
    """The phases whose two marks are known, in seconds."""
    return {
        name: max(0.0, marks[b] - marks[a])
        for name, (a, b) in PHASES.items()
        if marks.get(a) and b in marks
    }


class PushWorker:
    def __init__(
        self, config: ConnectorConfig, vllm_config: VllmConfig, agent_factory: AgentFactory = Agent
    ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self._agent_factory = agent_factory  # the transport: NIXL's, or a test's in-memory one
        self.endpoint: Any = None
        self._futures: dict[str, Future] = {}  # req_id -> push, expect or cancel
        self._timeline: dict[str, tuple[str, dict[str, float]]] = {}  # req_id -> transfer_id,
        # marks known before the endpoint's (Push.finished_s)
        self._cancelled: set[str] = set()
        self._faults: dict[str, str] = {}  # debug_faults: req_id -> worker hook to raise in
        self._refused: set[str] = set()  # decode: loads to report as failed
        self._unsent: set[str] = set()  # prefill: pushes that could not start
        self._stats = KVPushStats()
        self._last_gauges: dict[str, int] = {}
        self._last_fallbacks: dict[str, int] = {}  # the endpoint's, at the last take_stats
        self._settling: list[Future] = []  # aborts and cancels not yet acted on
        self._last_settling = 0
        # layer by layer (prefill): each layer's regions; the step whose forward is running
        # (its metadata), the keys it writes layer by layer, and the CUDA event type where
        # the forward runs on a GPU (a layer is read once its kernels have run)
        self._layer_regions: dict[str, tuple[int, ...]] = {}
        self._layer_step: Any = None
        self._layer_keys: list[wire.TransferKey] = []
        self._cuda_event: Any = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        if self.config.gil_switch_interval_s is not None:  # process-wide: where measured
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        self.attach(
            kv_caches, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        )

    def attach(self, kv_caches: dict[str, torch.Tensor], rank: int, tp_size: int) -> None:
        """Start this rank's endpoint over its KV caches (vLLM's per-layer tensors)."""
        from kvpush.transfer.receiver import DecodeEndpoint
        from kvpush.transfer.writer import PrefillEndpoint

        cfg, vcfg = self.config, self.vllm_config
        model = vcfg.model_config
        layout = layout_from_kv_caches(
            kv_caches, vcfg.cache_config.block_size, model.get_total_num_kv_heads(), rank, tp_size
        )
        first = next(iter(kv_caches.values()))
        compat = wire.Compat(
            mode="push",
            model=model.served_model_name
            if isinstance(model.served_model_name, str)
            else str(model.model),
            dtype=str(first.dtype).removeprefix("torch."),
            layout_kind=wire.layout_kind(layout),
        )
        port = cfg.side_channel_port + rank if cfg.is_prefill else cfg.side_channel_port
        transfer = TransferConfig(
            engine_id=cfg.engine_id,
            compat=compat,
            rank=rank,
            tp_size=tp_size,
            side_channel_host=cfg.side_channel_host,
            side_channel_port=port,
            backends=cfg.backends,
            lease_s=cfg.lease_s,
            dead_after_s=cfg.dead_after_s,
            heartbeat_s=cfg.heartbeat_s,
            debug_checksum=cfg.debug_checksum,
            fast_poll_s=cfg.fast_poll_s,
            staging_bytes=None if cfg.staging_mib is None else cfg.staging_mib << 20,
            staging_min_descs=cfg.staging_min_descs,
        )
        cls = PrefillEndpoint if cfg.is_prefill else DecodeEndpoint
        self.endpoint = cls(transfer, layout, self._agent_factory)
        if cfg.is_prefill and cfg.layerwise:
            self._layer_regions = layer_regions(kv_caches)
            if first.device.type == "cuda":
                import torch

                self._cuda_event = torch.cuda.Event
        log.info(
            "kvpush %s rank %d/%d listening on %s: %d layers, %d blocks of %d tokens, %s",
            cls.role,
            rank,
            tp_size,
            self.endpoint.address,
            len(kv_caches),
            layout.num_blocks,
            layout.block_size,
            compat.layout_kind,
        )

    def start(self, actions: list[m.Action]) -> None:
        for action in actions:
            try:
                self._start(action)
            except Exception as e:  # never raise into the engine: fail this request alone
                log.warning("kvpush: %s failed: %s", action, e)
                if isinstance(action, m.Prepare):  # only a head start: the push plans anew
                    self.fell_back("layerwise" if action.layerwise else "ready_ahead")
                    continue
                req_id = getattr(action, "req_id", None)
                if isinstance(action, m.Push):  # vLLM frees its blocks once it is "sent"
                    self._unsent.add(action.req_id)
                    with contextlib.suppress(Exception):  # decode fails it, not at its lease
                        failure = wire.Failure("other", f"push not started: {e}")
                        self._settling.append(self.endpoint.abort(action.key, failure))
                elif req_id is not None:
                    self._refused.add(req_id)
                self._stats.record(False, 0, 0, 0.0, cause="other")

    def fell_back(self, path: str, cause: str = "error") -> None:
        """A transfer left `path` for the plain one (counted in kvpush:fallbacks)."""
        self._stats.fell_back({wire.fallback_key(path, cause): 1})

    @property
    def layerwise(self) -> bool:
        return bool(self._layer_regions)

    def layer_saved(self, layer_name: str, meta: Any) -> None:
        """vLLM's forward has computed `layer_name` (save_kv_layer): write it for every
        request of this step that is written layer by layer. At the step's first layer the
        step's `Prepare`s are handed over here, before the forward goes on, rather than
        after it (start())."""
        if meta is not self._layer_step:
            self._layer_step = meta
            prepares = [a for a in meta.actions if isinstance(a, m.Prepare) and a.layerwise]
            for a in prepares:
                self.endpoint.prepare(a.key, a.block_ids, a.num_tokens)
            self._layer_keys = [a.key for a in prepares]
        regions = self._layer_regions.get(layer_name)
        if not self._layer_keys or regions is None:
            return
        ready = None
        if self._cuda_event is not None:  # the forward's kernels may not have run yet
            event = self._cuda_event()
            event.record()
            ready = event.query
        self.endpoint.computed(self._layer_keys, list(regions), ready)

    def _start(self, a: m.Action) -> None:
        ep = self.endpoint
        if isinstance(a, m.Push | m.Expect) and a.fault:
            if a.fault == "start_load_kv":
                raise RuntimeError(f"kvpush debug fault in start_load_kv for {a.req_id}")
            self._faults[a.req_id] = a.fault
        if isinstance(a, m.Push):
            marks = {"finished": a.finished_s, "started": time.monotonic()}
            self._timeline[a.req_id] = (a.key.transfer_id, marks)
            self._futures[a.req_id] = ep.push(a.key, a.block_ids, a.num_tokens, a.first_token)
        elif isinstance(a, m.Prepare):
            if not (a.layerwise and a.key in self._layer_keys):  # else handed over already
                ep.prepare(a.key, a.block_ids, a.num_tokens)
        elif isinstance(a, m.Abort):
            self._settling.append(ep.abort(a.key, a.failure))
        elif isinstance(a, m.Expect):
            self._timeline[a.req_id] = (a.key.transfer_id, {})
            self._futures[a.req_id] = ep.expect(
                a.key, a.prefill, a.block_ids, a.num_tokens, a.num_cached_tokens
            )
        elif isinstance(a, m.Cancel):
            if a.req_id is None:
                self._settling.append(ep.cancel(a.key, a.prefill))
            elif a.req_id in self._futures:  # else it was reported already: nothing held
                self._futures[a.req_id] = ep.cancel(a.key)
                self._cancelled.add(a.req_id)
        elif isinstance(a, m.Refuse):
            self._refused.add(a.req_id)
            self._stats.record(False, 0, 0, 0.0, cause=a.failure.cause)

    def wait_idle(self) -> None:
        """On a step that schedules no tokens: wait until a transfer in flight completes, at
        most `idle_wait_s`. Only local futures are waited on (the endpoint's thread does the
        network), and the GIL is free meanwhile, so that thread runs at once. Without it,
        vLLM steps again at once, and on a shared core each empty step's work delays the
        transfer and the API server's answer."""
        if self.config.idle_wait_s > 0 and self._futures:
            wait(list(self._futures.values()), self.config.idle_wait_s, FIRST_COMPLETED)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call.

        Every finished id is collected, and counted as reported, before anything that can
        raise: a request vLLM is never told about would hold its blocks for ever. Each
        future is then read on its own; a load whose outcome cannot be read is failed
        (decode then has no first token to continue from), a push's is reported sent."""
        sending = set(self._unsent)
        recving, failed = set(self._refused), set(self._refused)
        self._refused.clear()
        self._unsent.clear()
        done = [(req_id, f) for req_id, f in self._futures.items() if f.done()]
        for req_id, _ in done:
            del self._futures[req_id]
            (sending if self.config.is_prefill else recving).add(req_id)
        for req_id, future in done:
            cancelled = req_id in self._cancelled
            self._cancelled.discard(req_id)
            try:
                ok = self._settle(req_id, future, cancelled)
            except Exception:
                log.exception("kvpush: reading %s's transfer result failed", req_id)
                ok = False
                with contextlib.suppress(Exception):
                    self._stats.record(False, 0, 0, 0.0, cause="other")
            if not ok and not cancelled and not self.config.is_prefill:
                failed.add(req_id)
        return sending, recving, failed

    def _settle(self, req_id: str, future: Future, cancelled: bool) -> bool:
        """One finished transfer: its stats, timeline and (decode) first token; whether it
        succeeded."""
        if self._faults.pop(req_id, "") == "get_finished":
            raise RuntimeError(f"kvpush debug fault in get_finished for {req_id}")
        outcome = future.result()
        transfer_id, marks = self._timeline.pop(req_id, ("", {}))
        if outcome.ok and not self.config.is_prefill and outcome.first_token >= 0:
            firsttoken.offer(transfer_id, outcome.first_token)
        if not cancelled:
            phases = timeline_phases(marks | outcome.marks | {"reported": time.monotonic()})
            self._stats.record(
                outcome.ok,
                outcome.num_bytes,
                outcome.num_descs,
                outcome.elapsed_s,
                phases,
                cause=outcome.cause,
            )
            if log.isEnabledFor(logging.DEBUG):  # formatting the phases is not free
                log.debug(
                    "kvpush: %s transfer_id=%s %s ok=%s %s bytes=%d descs=%d phases_ms: %s",
                    req_id,
                    transfer_id or "-",
                    "push" if self.config.is_prefill else "load",
                    outcome.ok,
                    outcome.reason,
                    outcome.num_bytes,
                    outcome.num_descs,
                    " ".join(f"{k}={v * 1e3:.2f}" for k, v in phases.items()),
                )
        return outcome.ok

    def take_stats(self) -> KVPushStats | None:
        """Stats for this step, or None when nothing changed since the last one.

        `settling` counts aborts and cancels the endpoint has not acted on yet: no
        request waits on them, so without it the engine could go idle before the gauges
        show their effect. The scheduler keeps the engine stepping while it is above 0."""
        self._settling = [f for f in self._settling if not f.done()]
        settling = len(self._settling)
        fallbacks = self.endpoint.fallbacks() if self.endpoint is not None else {}
        last, self._last_fallbacks = self._last_fallbacks, fallbacks
        self._stats.fell_back(
            {k: n - last.get(k, 0) for k, n in fallbacks.items() if n > last.get(k, 0)}
        )
        gauges = self.endpoint.gauges() if self.endpoint is not None else {}
        gauges = {k: v for k, v in gauges.items() if k in GAUGES}
        unchanged = gauges == self._last_gauges and settling == self._last_settling
        if unchanged and self._stats.is_empty():
            return None
        self._last_gauges, self._last_settling = gauges, settling
        stats, self._stats = self._stats, KVPushStats()
        stats.data["gauges"] = gauges
        stats.data["settling"] = settling
        return stats

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
