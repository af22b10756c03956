"""kvpush's gauges and counters, carried by vLLM's connector-stats path to /metrics.

Each engine step the worker sends a `KVPushStats` when something changed: the endpoint's
gauges (latest values) and counters since the last step. vLLM hands them to the API server
process, where `KVPushPromMetrics` exposes them as `kvpush:*` metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpush.transfer.wire import CAUSES, FALLBACK_CAUSES, FALLBACK_PATHS, fallback_key

if TYPE_CHECKING:  # vLLM's types, for the checker only
    from vllm.config import VllmConfig

GAUGES = {
    "pending_match": "prefill: transfers waiting for their registration or their prefill",
    "registrations": "prefill: decode ranks registered and not yet written",
    "layered": "prefill: transfers being written layer by layer",
    "layer_writes_in_flight": "prefill: layer WRITEs posted and not yet complete",
    "in_flight": "prefill: WRITEs posted and not yet complete",
    "held_sources": "prefill: requests whose blocks are held for a push",
    "expected": "decode: requests whose blocks wait for prefill's WRITEs",
    "expected_blocks": "decode: blocks held waiting for prefill",
    "quarantined_blocks": "decode: cancelled blocks prefill has not released yet",
    "staging_held_bytes": "bytes of the staging area held by slots of staged pushes",
}
# kvpush.vllm.worker.PHASES, named here so this module stays importable without the worker
PHASE_NAMES = (
    "handover", "next_step", "head_start", "ready_ahead", "layers_ahead", "pair_and_post",
    "write", "release", "register", "wait_writes", "land", "scatter", "report",
)  # fmt: skip
PHASE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


def _empty() -> dict[str, Any]:
    return {
        "gauges": {},
        "transfers": 0,
        "num_bytes": 0,
        "num_descs": 0,
        "failures": {},
        "fallbacks": {},  # wire.fallback_key -> times
        "elapsed_s": [],
        "phases_s": {},
        "settling": 0,
    }


class KVPushStats(KVConnectorStats):
    """Runs in vLLM's processes on data that crossed a process boundary: every read has a
    default, since an exception here would fail requests."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=_empty() | (data or {}))

    def reset(self) -> None:
        self.data = _empty()

    def record(
        self,
        ok: bool,
        num_bytes: int,
        num_descs: int,
        elapsed_s: float,
        phases_s: dict[str, float] | None = None,
        cause: str = "other",
    ) -> None:
        """One transfer's end: counted as done, or as failed by its cause (wire.CAUSES)."""
        for name, seconds in (phases_s or {}).items():
            self.data["phases_s"].setdefault(name, []).append(seconds)
        if ok:
            self.data["transfers"] += 1
            self.data["num_bytes"] += num_bytes
            self.data["num_descs"] += num_descs
            self.data["elapsed_s"].append(elapsed_s)
        else:
            self.data["failures"][cause] = self.data["failures"].get(cause, 0) + 1

    def fell_back(self, counts: dict[str, int]) -> None:
        """Transfers that left a faster path for the plain one (wire.FALLBACK_PATHS)."""
        for key, n in counts.items():
            self.data["fallbacks"][key] = self.data["fallbacks"].get(key, 0) + n

    def aggregate(self, other: KVConnectorStats) -> KVPushStats:
        o = other.data
        self.data["gauges"] = o.get("gauges") or self.data["gauges"]  # latest wins
        # across ranks of one step: any rank still settling keeps the engine stepping
        self.data["settling"] = max(self.data.get("settling", 0), o.get("settling", 0))
        for name in ("transfers", "num_bytes", "num_descs"):
            self.data[name] += o.get(name, 0)
        for cause, n in o.get("failures", {}).items():
            self.data["failures"][cause] = self.data["failures"].get(cause, 0) + n
        self.fell_back(o.get("fallbacks", {}))
        self.data["elapsed_s"] = self.data["elapsed_s"] + list(o.get("elapsed_s", []))
        for name, values in o.get("phases_s", {}).items():
            self.data["phases_s"][name] = self.data["phases_s"].get(name, []) + list(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        times = d["elapsed_s"]
        out: dict[str, int | float] = {
            "transfers": d["transfers"],
            "MB": round(d["num_bytes"] / 1e6, 3),
            "descriptors": d["num_descs"],
            "failures": sum(d["failures"].values()),
            "fallbacks": sum(d.get("fallbacks", {}).values()),
            "median_ms": round(float(np.median(times)) * 1e3, 2) if times else 0,
        }
        return out | d["gauges"]

    def is_empty(self) -> bool:
        d = self.data
        busy = d["gauges"] or d["transfers"] or d["failures"] or d.get("settling")
        busy = busy or d.get("fallbacks")
        return not (busy or d.get("phases_s"))


class KVPushPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        # vLLM types its metric classes as one union; each here is the one its name says
        gauge_cls: Any = self._gauge_cls
        counter_cls: Any = self._counter_cls
        histogram_cls: Any = self._histogram_cls

        def per_engine(cls: Any, name: str, doc: str, **kwargs: Any) -> dict:
            return create_metric_per_engine(
                cls(name=name, documentation=doc, labelnames=labelnames, **kwargs),
                per_engine_labelvalues,
            )

        self.gauges = {
            name: per_engine(gauge_cls, f"kvpush:{name}", doc) for name, doc in GAUGES.items()
        }
        self.transfers = per_engine(counter_cls, "kvpush:transfers", "completed transfers")
        self.num_bytes = per_engine(counter_cls, "kvpush:transferred_bytes", "bytes moved")
        self.num_descs = per_engine(counter_cls, "kvpush:descriptors", "descriptors posted")
        failures = counter_cls(
            name="kvpush:failures",
            documentation="failed transfers by cause",
            labelnames=[*labelnames, "cause"],
        )
        self.failures = {
            idx: {c: failures.labels(*values, c) for c in CAUSES}
            for idx, values in per_engine_labelvalues.items()
        }
        fallbacks = counter_cls(
            name="kvpush:fallbacks",
            documentation="transfers that left a faster path (made ready ahead, layer by "
            "layer, staged) for the plain one, by path and cause; they still completed",
            labelnames=[*labelnames, "path", "cause"],
        )
        self.fallbacks = {
            idx: {
                fallback_key(p, c): fallbacks.labels(*values, p, c)
                for p in FALLBACK_PATHS
                for c in FALLBACK_CAUSES
            }
            for idx, values in per_engine_labelvalues.items()
        }
        phases = histogram_cls(
            name="kvpush:phase_seconds",
            documentation="per-request timeline phases in the connector (kvpush.vllm.worker."
            "PHASES): prefill handover, next_step, head_start, pair_and_post, write, release; "
            "decode register, wait_writes, land, scatter, report",
            labelnames=[*labelnames, "phase"],
            buckets=PHASE_BUCKETS_S,
        )
        self.phases = {
            idx: {p: phases.labels(*values, p) for p in PHASE_NAMES}
            for idx, values in per_engine_labelvalues.items()
        }
        self.seconds = per_engine(
            histogram_cls,
            "kvpush:transfer_seconds",
            "hand-over (prefill) or registration (decode) to completion",
            # given, not prometheus_client's default: Ray's metrics (an engine under Ray
            # Serve) refuse a histogram without boundaries
            buckets=PHASE_BUCKETS_S,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for name, value in d.get("gauges", {}).items():
            if name in self.gauges:
                self.gauges[name][engine_idx].set(value)
        self.transfers[engine_idx].inc(d.get("transfers", 0))
        self.num_bytes[engine_idx].inc(d.get("num_bytes", 0))
        self.num_descs[engine_idx].inc(d.get("num_descs", 0))
        for cause, n in d.get("failures", {}).items():
            self.failures[engine_idx].get(cause, self.failures[engine_idx]["other"]).inc(n)
        for key, n in d.get("fallbacks", {}).items():
            counter = self.fallbacks[engine_idx].get(key)
            if counter is not None:
                counter.inc(n)
        for seconds in d.get("elapsed_s", []):
            self.seconds[engine_idx].observe(seconds)
        for name, values in d.get("phases_s", {}).items():
            histogram = self.phases[engine_idx].get(name)
            if histogram is None:  # a phase another version names
                continue
            for seconds in values:
                histogram.observe(seconds)
