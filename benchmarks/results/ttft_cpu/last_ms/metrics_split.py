import asyncio, json, random, sys, time, re, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); PROXY = len(sys.argv) > 2
NAMES = ["vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:e2e_request_latency_seconds"]
async def metrics(s):
    async with s.get("http://127.0.0.1:8100/metrics") as r:
        text = await r.text()
    out = {}
    for n in NAMES:
        m1 = re.search(re.escape(n) + r"_sum\{[^}]*\} ([0-9.e+-]+)", text); m2 = re.search(re.escape(n) + r"_count\{[^}]*\} ([0-9.e+-]+)", text)
        out[n] = (float(m1.group(1)), float(m2.group(1)))
    return out
async def main():
    rng = random.Random(time.time_ns()); acc = {"direct": {}, "front": {}}; client = {"direct": [], "front": []}
    async with httpclient.session() as s:
        for i in range(N):
            for kind in rng.sample(["direct", "front"], 2):
                hdr = {"x-kvpush-front-end": "off"} if kind == "direct" else {}
                await asyncio.sleep(0.5)
                before = await metrics(s)
                await asyncio.sleep(0.05)
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                t0 = time.perf_counter(); first = None
                async with s.post(("http://127.0.0.1:8000" if kind == "front" and PROXY else "http://127.0.0.1:8100") + "/v1/completions", json=body, headers=hdr) as r:
                    async for ev in httpclient.sse_events(r):
                        if ev.get("choices") and first is None: first = time.perf_counter()
                client[kind].append((first - t0) * 1e3)
                await asyncio.sleep(0.3)
                after = await metrics(s)
                for n in NAMES:
                    ds, dc = after[n][0] - before[n][0], after[n][1] - before[n][1]
                    if dc == 1: acc[kind].setdefault(n, []).append(ds * 1e3)
    for k in acc:
        print(k, "client ttft %.2f" % st.median(client[k]), {n.split(":")[1]: (round(st.median(v), 2), len(v)) for n, v in acc[k].items()})
asyncio.run(main())
