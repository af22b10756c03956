"""What recording the per-request timeline costs, per request, on this host's CPU.

- proxy: a Trace, its six marks, and `ProxyMetrics.observe_latency` (every phase into its
  Prometheus histogram, the recent-timelines ring, the debug-log check);
- engine: one transfer's marks turned into phases (`timeline_phases`) and recorded into the
  connector's stats (`KVPushStats.record`), as the worker does once per transfer.

Nothing is recorded per token. Medians of 7 rounds of 20,000 requests each, in microseconds.

    .venv/bin/python benchmarks/scripts/timeline_cost.py OUT.json
"""

import json
import platform
import statistics
import sys
import time

from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.timeline import EVENTS, Trace
from kvpush.vllm.stats import KVPushStats
from kvpush.vllm.worker import timeline_phases

NUM_REQUESTS = 20_000  # per round: long enough that the clock's resolution does not matter
NUM_ROUNDS = 7


def proxy_round(metrics: ProxyMetrics) -> float:
    start = time.perf_counter()
    for _ in range(NUM_REQUESTS):
        trace = Trace(None)
        for event in EVENTS:
            trace.mark(event)
        trace.num_chunks = 16
        trace.status = "ok"
        metrics.observe_latency(trace)
    return (time.perf_counter() - start) / NUM_REQUESTS


def engine_round() -> float:
    stats = KVPushStats()
    start = time.perf_counter()
    for i in range(NUM_REQUESTS):
        t = time.monotonic()
        marks = {"finished": t, "started": t, "handed": t, "posted": t, "written": t}
        phases = timeline_phases(marks | {"reported": time.monotonic()})
        stats.record(True, 1 << 20, 4, 0.001, phases)
        if i % 1000 == 999:  # the worker hands its stats to vLLM every step
            stats = KVPushStats()
    return (time.perf_counter() - start) / NUM_REQUESTS


def main(out: str) -> None:
    metrics = ProxyMetrics()
    proxy_us = [proxy_round(metrics) * 1e6 for _ in range(NUM_ROUNDS)]
    engine_us = [engine_round() * 1e6 for _ in range(NUM_ROUNDS)]
    result = {
        "benchmark": "timeline_cost",
        "num_requests_per_round": NUM_REQUESTS,
        "num_rounds": NUM_ROUNDS,
        "proxy_us_per_request": statistics.median(proxy_us),
        "engine_us_per_transfer": statistics.median(engine_us),
        "proxy_us_rounds": proxy_us,
        "engine_us_rounds": engine_us,
        "hardware": {"machine": platform.machine(), "python": platform.python_version()},
        "created_unix_s": int(time.time()),
    }
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("rounds")}, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
