"""Where the client's TTFT through the proxy goes, one streamed request at a time (issue 10).

Starts the local kvpush stack (1 prefill + 1 decode + the proxy, as `kvpush bench ttft`),
then, for each target, REQUESTS streamed requests of 300 random token ids and 64 output
tokens, Poisson-spaced at 0.5/s, after two warm-ups, each prompt new (prefill caches
prefixes):

- proxy: through the proxy. The client's send and first token (time.perf_counter, the host's
  monotonic clock) are joined with the proxy's /timelines (arrival on the same clock):
  hop_in = client send -> the proxy's handler; hop_out = the proxy's first token written ->
  the client has it; the proxy's own events in between;
- front_end: through the front end in the prefill engine's API server (proxy/frontend.py),
  joined with its /kvpush/timelines as the proxy's;
- prefill_stream: straight to the prefill engine (its front end told to step aside),
  streamed (what the client's TTFT would be with no proxy and no transfer);
- prefill_one: straight to the prefill engine, not streamed, max_tokens 1 (the request the
  proxy's prefill leg sends, less kv_transfer_params).

For each, vLLM's own means on the prefill engine over the same requests (its /metrics):
e2e_request_latency (from the request's arrival in the engine's front end, after HTTP and
input processing, to its final output there) and request_prefill_time. What the client or
the proxy waits beyond e2e is HTTP and the API server around the engine.

Run on this host: python benchmarks/scripts/ttft_hops.py OUT.json [SEED [CONNECTOR_EXTRA_JSON]]
"""

import asyncio
import json
import random
import sys
import time

import aiohttp
import numpy as np

from kvpush import httpclient
from kvpush.proxy.frontend import OFF_HEADER

REQUESTS = 12
PROMPT, OUTPUT = 300, 64
VLLM = ("e2e_request_latency", "request_prefill_time")


async def one(s: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> tuple[float, float]:
    """(send, first token) on the monotonic clock."""
    from kvpush.httpclient import sse_events

    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        if not body["stream"]:
            await r.read()
            return t0, time.perf_counter()
        first = None
        async for event in sse_events(r):
            if first is None and event.get("choices"):
                first = time.perf_counter()
        assert first is not None, "no token in the stream"
        return t0, first


async def vllm_means(s: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, float]]:
    """vLLM's histograms named in VLLM on an engine's /metrics: name -> (sum s, count)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("vllm:").removesuffix("_seconds")
        if name not in VLLM:
            continue
        for sample in family.samples:
            kind = sample.name.rsplit("_", 1)[-1]
            if kind in ("sum", "count"):
                out.setdefault(name, [0.0, 0.0])[kind == "count"] += sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


async def run(proxy: str, prefill: str, seed: int) -> dict:
    from kvpush.launch.tinymodel import VOCAB_SIZE

    rng = random.Random(seed)
    alone = {OFF_HEADER.decode(): "off"}  # the prefill engine without its front end
    targets = {  # name: (url, body fields, headers, where its timelines are)
        "proxy": (proxy, {}, {}, proxy),
        "front_end": (prefill, {}, {}, prefill + "/kvpush"),
        "prefill_stream": (prefill, {}, alone, None),
        "prefill_one": (prefill, {"stream": False, "max_tokens": 1}, alone, None),
    }
    out: dict = {}
    async with httpclient.session(max_connections=1) as s:
        for name, (url, kw, headers, timelines_at) in targets.items():

            def body(kw: dict = kw) -> dict:
                prompt = [rng.randrange(100, VOCAB_SIZE) for _ in range(PROMPT)]
                return {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT,
                        "ignore_eos": True, "stream": True} | kw  # fmt: skip

            for _ in range(2):
                await one(s, url, body(), headers)
            before = await vllm_means(s, prefill)
            times = []
            for _ in range(REQUESTS):
                await asyncio.sleep(rng.expovariate(0.5))
                times.append(await one(s, url, body(), headers))
            after = await vllm_means(s, prefill)
            out[name] = {
                "client_ttft_ms": [(t1 - t0) * 1e3 for t0, t1 in times],
                "vllm_prefill_means_ms": {
                    k: (after[k][0] - before[k][0]) / (after[k][1] - before[k][1]) * 1e3
                    for k in after
                },
            }
            if timelines_at is not None:
                await asyncio.sleep(1)
                async with s.get(timelines_at + "/timelines") as r:
                    timelines = (await r.json())["timelines"][-REQUESTS:]
                hops = []
                for (t0, t1), t in zip(times, timelines, strict=True):
                    arrival, events = t["arrival_monotonic_s"], t["events_s"]
                    hops.append({
                        "hop_in": arrival - t0,
                        **{k: v for k, v in events.items() if k != "arrival"},
                        "hop_out": t1 - (arrival + events["first_token"]),
                    })  # fmt: skip
                out[name]["hops_ms"] = [{k: v * 1e3 for k, v in h.items()} for h in hops]
    return out


def medians(out: dict) -> dict:
    m = {f"{k}_client_ttft": float(np.median(v["client_ttft_ms"])) for k, v in out.items()}
    for name in ("proxy", "front_end"):
        hops = out[name]["hops_ms"]
        m |= {f"{name}_{k}": float(np.median([h[k] for h in hops])) for k in hops[0]}
        leg = [h["prefill_answer"] - h["legs_sent"] for h in hops]
        m[f"{name}_prefill_leg"] = float(np.median(leg))
    for k, v in out.items():
        m |= {f"{k}_vllm_{n}_mean": x for n, x in v["vllm_prefill_means_ms"].items()}
    return {k: round(v, 2) for k, v in m.items()}


def main(path: str, seed: int = 0, extra: dict | None = None) -> None:
    from kvpush.launch import tinymodel
    from kvpush.launch.stack import PROXY_PORT, Stack, stack_specs
    from kvpush.settings import SETTINGS

    model = str(tinymodel.ensure())
    specs = stack_specs(model, "kvpush", 1, 1, connector_extra=extra or {})
    stack = Stack(specs, "kvpush", PROXY_PORT, SETTINGS.cache_dir / "logs", front_end=True)
    stack.start()
    try:
        out = asyncio.run(run(stack.url, stack.specs[0].url, seed))
    finally:
        stack.stop()
    result = {"benchmark": "ttft_hops", "seed": seed, "connector_extra": extra or {}}
    result |= {"medians_ms": medians(out), "runs": out}
    result["created_unix_s"] = int(time.time())
    print(json.dumps(result["medians_ms"], indent=1))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    extra = json.loads(args[2]) if len(args) > 2 else None
    main(args[0], int(args[1]) if len(args) > 1 else 0, extra)
