"""kvpush:fallbacks: each rank's counts, aggregated over ranks and steps, reach /metrics as a
counter by path and cause (the real engines' /metrics: tests/transfer/test_staging.py counts
them at the endpoint, tests/e2e the failures counter beside it)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpush.vllm.stats import KVPushPromMetrics, KVPushStats


def test_fallbacks_from_every_rank_are_counted_by_path_and_cause():
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = KVPushPromMetrics(config, types, ["engine"], {0: ["0"]})
    rank0, rank1 = KVPushStats(), KVPushStats()
    rank0.fell_back({"staged:full": 2})
    rank1.fell_back({"staged:full": 1, "ready_ahead:error": 1})
    assert not rank1.is_empty()  # a step with only a fallback is still sent
    step = rank0.aggregate(rank1)
    assert step.reduce()["fallbacks"] == 4
    metrics.observe(step.data)
    metrics.observe(KVPushStats(data={"fallbacks": {"layerwise:error": 1, "bogus:x": 5}}).data)

    def count(path: str, cause: str) -> float | None:
        labels = {"engine": "0", "path": path, "cause": cause}
        return registry.get_sample_value("kvpush:fallbacks_total", labels)

    assert count("staged", "full") == 3
    assert count("ready_ahead", "error") == 1
    assert count("layerwise", "error") == 1
    assert count("staged", "error") == 0  # every path and cause is there from the start
    assert count("bogus", "x") is None  # unknown names from another version are dropped
