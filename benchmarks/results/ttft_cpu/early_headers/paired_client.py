import asyncio, json, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]
KINDS = {"direct": {"x-kvpush-front-end": "off"}, "early": {}, "late": {"x-kvx-late": "1"}}
async def main():
    rng = random.Random(time.time_ns()); res = {k: [] for k in KINDS}
    async with httpclient.session() as s:
        for i in range(N):
            order = list(KINDS); rng.shuffle(order)
            for kind in order:
                await asyncio.sleep(0.5)
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                t0 = time.perf_counter(); first = None; n = 0
                async with s.post("http://127.0.0.1:8100/v1/completions", json=body, headers=KINDS[kind]) as r:
                    async for ev in httpclient.sse_events(r):
                        if ev.get("choices"):
                            n += 1
                            if first is None: first = time.perf_counter()
                last = time.perf_counter()
                res[kind].append({"ttft": (first - t0) * 1e3, "tpot": (last - first) * 1e3 / max(1, n - 1), "n": n})
    json.dump(res, open(out, "w"))
    for k, v in res.items():
        print(k, "ttft p50 %.2f" % st.median(x["ttft"] for x in v), "tpot p50 %.2f" % st.median(x["tpot"] for x in v), "n", len(v), "tokens", set(x["n"] for x in v))
asyncio.run(main())
