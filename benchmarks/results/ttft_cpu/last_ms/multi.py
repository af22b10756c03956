import asyncio, json, os, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]; plen = int(sys.argv[3]) if len(sys.argv) > 3 else 256
KINDS = {"mono": ("http://127.0.0.1:8300", {}), "direct": ("http://127.0.0.1:8100", {"x-kvpush-front-end": "off"}),
         "front": ("http://127.0.0.1:8100", {}), "proxy": ("http://127.0.0.1:8000", {})}
async def main():
    rng = random.Random(time.time_ns()); res = {k: [] for k in KINDS}
    async with httpclient.session() as s:
        for i in range(N):
            order = list(KINDS); rng.shuffle(order)
            for kind in order:
                url, hdr = KINDS[kind]
                await asyncio.sleep(0.5)
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(plen)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                t0 = time.perf_counter(); times = []
                async with s.post(url + "/v1/completions", json=body, headers=hdr) as r:
                    async for ev in httpclient.sse_events(r):
                        if ev.get("choices"):
                            times.append(time.perf_counter())
                res[kind].append({"ttft": (times[0] - t0) * 1e3, "itl0": (times[1] - times[0]) * 1e3, "tpot": (times[-1] - times[0]) * 1e3 / max(1, len(times) - 1), "n": len(times)})
    json.dump(res, open(out, "w"))
    m = {k: st.median(x["ttft"] for x in v) for k, v in res.items()}
    for k, v in res.items():
        print("%-7s ttft p50 %.2f  x mono %.3f  itl0 p50 %.2f  tpot p50 %.2f  n %d" % (k, m[k], m[k] / m["mono"], st.median(x["itl0"] for x in v), st.median(x["tpot"] for x in v), len(v)))
    for k in ("direct", "front", "proxy"):
        d = [a["ttft"] / b["ttft"] for a, b in zip(res[k], res["mono"])]
        print("%s/mono paired ratio median %.3f (faster in %d/%d)" % (k, st.median(d), sum(x < 1 for x in d), len(d)))
asyncio.run(main())
