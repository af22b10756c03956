import asyncio, json, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]; url = "http://127.0.0.1:8100"
async def main():
    rng = random.Random(time.time_ns()); res = []
    async with httpclient.session() as s:
        for i in range(N):
            await asyncio.sleep(0.5)
            body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
            t0 = time.perf_counter(); times = []
            async with s.post(url + "/v1/completions", json=body) as r:
                async for ev in httpclient.sse_events(r):
                    if ev.get("choices"):
                        times.append(time.perf_counter())
            res.append({"ttft": (times[0] - t0) * 1e3, "itl0": (times[1] - times[0]) * 1e3})
    json.dump(res, open(out, "w"))
asyncio.run(main())
