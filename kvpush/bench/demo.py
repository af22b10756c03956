"""`make demo`: the local stack with kvpush, then with vLLM's pull connector; a few requests
through the proxy each time; TTFT and TPOT side by side; everything stopped afterwards."""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvpush.bench import vllm_bench

CONNECTORS = ("kvpush", "nixl-pull")
NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN, QPS = 6, 1024, 16, 1.0


def main() -> int:
    from kvpush.bench.stacks import mode_stack
    from kvpush.launch import tinymodel
    from kvpush.settings import SETTINGS

    model = str(tinymodel.ensure())
    rows = {}
    for connector in CONNECTORS:
        print(f"== {connector}: starting 1 prefill + 1 decode + proxy (about a minute)", flush=True)
        # kvpush pushes every prompt here: the demo compares push with pull (its default,
        # auto, would serve these few requests as plain replicas: docs/design/proxy.md)
        stack = mode_stack(connector, model, SETTINGS.cache_dir / "logs", disaggregation="always")
        stack.start()
        try:
            print(f"{connector}: {NUM_REQUESTS} requests (vllm bench serve)", flush=True)
            vllm_bench.warm_up(stack.url, model, "tiny", INPUT_LEN, OUTPUT_LEN)
            load = vllm_bench.Load(QPS, INPUT_LEN, OUTPUT_LEN, NUM_REQUESTS, seed=1)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{connector}.json"
                rows[connector] = vllm_bench.run(stack.url, model, "tiny", load, path, quiet=True)
        finally:
            stack.stop()
    print(
        f"\n{NUM_REQUESTS} requests of {INPUT_LEN} prompt tokens, {OUTPUT_LEN} output tokens, "
        f"{QPS:g} QPS, through the proxy, on this machine:"
    )
    print(
        f"{'connector':<10} {'TTFT median ms':>15} {'TTFT p99 ms':>12} {'TPOT median ms':>15}"
        f" {'failed':>7}"
    )
    for connector, r in rows.items():
        print(
            f"{connector:<10} {r['median_ttft_ms']:>15.1f} {r['p99_ttft_ms']:>12.1f} "
            f"{r['median_tpot_ms']:>15.1f} {r['failed']:>7}"
        )
    if "kvpush" in rows and rows["nixl-pull"]["median_ttft_ms"]:
        ratio = rows["kvpush"]["median_ttft_ms"] / rows["nixl-pull"]["median_ttft_ms"]
        print(f"kvpush / pull TTFT: {ratio:.2f}")
    return 0 if all(r["failed"] == 0 for r in rows.values()) else 1
