"""What slows a push request's prefill leg (issue 10), one request at a time.

Starts the local kvpush stack with the front end (as `kvpush bench ttft`), then sends 300-token
prompts of random token ids to the prefill engine in rounds, each round every kind once in a
shuffled order, 1 s apart, and reads the prefill engine's vLLM histograms around each request
(its /metrics: request_prefill_time, e2e_request_latency, request_queue_time). Kinds:

- plain_one: max_tokens 1, not streamed, the front end told to step aside;
- plain_stream: 64 tokens streamed, likewise (what a client straight to prefill gets);
- leg_alone: the prefill leg a router sends (kv_transfer_params do_remote_decode), no decode;
- leg_and_busy_decode: that leg, with a plain request on the decode engine at the same time;
- leg_and_decode_leg: that leg and its decode leg, both sent by this client (no proxy);
- front_end / proxy: a whole streamed request through the front end or the proxy.

Client time is to the first token (streamed) or the answer. Medians over ROUNDS rounds after
two not counted. Prefill's blocks for leg_alone wait for the lease (30 s), as nobody
registers.

Run on this host: python benchmarks/scripts/prefill_leg_parts.py OUT.json KIND[,KIND...]
"""

import asyncio
import json
import random
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvpush import httpclient
from kvpush.proxy.frontend import OFF_HEADER

ROUNDS = 12
VLLM = {
    "vllm:request_prefill_time_seconds": "prefill",
    "vllm:e2e_request_latency_seconds": "e2e",
    "vllm:request_queue_time_seconds": "queue",
}
ALONE = {OFF_HEADER.decode(): "off"}


async def sums(c, url: str) -> dict[str, float]:
    async with c.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in VLLM:
            for s in family.samples:
                if s.name.endswith("_sum"):
                    out[VLLM[family.name]] = out.get(VLLM[family.name], 0.0) + s.value
    return out


async def one(c, stack, kind: str, prompt: list[int], rng: random.Random) -> float:
    prefill, decode = stack.specs[0], stack.specs[1].url
    b = {"model": "tiny", "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    url, headers, side = prefill.url, {}, None
    tid = uuid.uuid4().hex
    leg = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}
    if kind == "plain_one":
        b, headers = b | {"max_tokens": 1}, ALONE
    elif kind == "plain_stream":
        b, headers = b | {"stream": True}, ALONE
    elif kind in ("leg_alone", "leg_and_busy_decode", "leg_and_decode_leg"):
        b |= leg
    elif kind == "front_end":
        b |= {"stream": True}
    elif kind == "proxy":
        b, url = b | {"stream": True}, stack.url
    else:
        raise ValueError(f"unknown kind {kind}")
    if kind == "leg_and_busy_decode":
        other = [rng.randrange(3, 4096) for _ in prompt]
        d_body = {"model": "tiny", "prompt": other, "max_tokens": 4}
        side = asyncio.ensure_future(c.post(decode + "/v1/completions", json=d_body))
    elif kind == "leg_and_decode_leg":
        params = {"do_remote_prefill": True, "transfer_id": tid, "remote_host": "127.0.0.1",
                  "remote_port": prefill.side_channel_port, "remote_engine_id": prefill.name,
                  "tp_size": 1}  # fmt: skip
        d_body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
        side = asyncio.ensure_future(c.post(decode + "/v1/completions", json=d_body))
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    async with c.post(url + "/v1/completions", json=b, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{kind}: HTTP {r.status}: {await r.text()}")
        first = None
        if b.get("stream"):
            async for event in httpclient.sse_events(r):
                if first is None and event.get("choices"):
                    first = time.perf_counter()
        else:
            await r.read()
            first = time.perf_counter()
    if side is not None:
        async with await side as r2:
            if r2.status != 200:
                raise RuntimeError(f"{kind}, decode: HTTP {r2.status}: {await r2.text()}")
            await r2.read()
    return (first - t0) * 1e3


async def run(stack, kinds: list[str]) -> dict:
    rng = random.Random(7)
    res = {k: {"client": [], "prefill": [], "e2e": [], "queue": []} for k in kinds}
    prefill = stack.specs[0].url
    async with httpclient.session() as c:
        for i in range(2 + ROUNDS):
            order = kinds[:]
            rng.shuffle(order)
            for kind in order:
                prompt = [rng.randrange(3, 4096) for _ in range(300)]
                before = await sums(c, prefill)
                ms = await one(c, stack, kind, prompt, rng)
                await asyncio.sleep(1.0)  # the engine's stats reach /metrics with its steps
                after = await sums(c, prefill)
                if i >= 2:
                    res[kind]["client"].append(ms)
                    for k in ("prefill", "e2e", "queue"):
                        res[kind][k].append((after.get(k, 0) - before.get(k, 0)) * 1e3)
                await asyncio.sleep(1.0 + rng.random())
    return res


def main(out: str, kinds: list[str]) -> None:
    from kvpush.launch import tinymodel
    from kvpush.launch.stack import PROXY_PORT, Stack, stack_specs
    from kvpush.settings import SETTINGS

    specs = stack_specs(str(tinymodel.ensure()), "kvpush", 1, 1)
    stack = Stack(specs, "kvpush", PROXY_PORT, SETTINGS.cache_dir / "logs", front_end=True)
    stack.start()
    try:
        res = asyncio.run(run(stack, kinds))
    finally:
        stack.stop()
    med = {k: {m: round(float(np.median(v)), 2) for m, v in d.items()} for k, d in res.items()}
    for k, v in med.items():
        print(k, v)
    result = {"benchmark": "prefill_leg_parts", "medians_ms": med, "runs": res}
    result["created_unix_s"] = int(time.time())
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
