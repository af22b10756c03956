import asyncio, json, os, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]; url = sys.argv[3]
KINDS = {"n0": 0, "n-10": -10}
async def main():
    rng = random.Random(time.time_ns()); res = {k: [] for k in KINDS}
    async with httpclient.session() as s:
        for i in range(N):
            order = list(KINDS); rng.shuffle(order)
            for kind in order:
                for tid in os.listdir("/proc/self/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), KINDS[kind])
                await asyncio.sleep(0.5)
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                t0 = time.perf_counter(); times = []
                async with s.post(url + "/v1/completions", json=body) as r:
                    async for ev in httpclient.sse_events(r):
                        if ev.get("choices"):
                            times.append(time.perf_counter())
                res[kind].append({"ttft": (times[0] - t0) * 1e3, "itl0": (times[1] - times[0]) * 1e3, "tpot": (times[-1] - times[0]) * 1e3 / max(1, len(times) - 1)})
    json.dump(res, open(out, "w"))
    for k, v in res.items():
        print(k, "ttft p50 %.2f" % st.median(x["ttft"] for x in v), "itl0 p50 %.2f" % st.median(x["itl0"] for x in v), "tpot p50 %.2f" % st.median(x["tpot"] for x in v))
    d = [a["ttft"] - b["ttft"] for a, b in zip(res["n-10"], res["n0"])]
    print("paired n-10 - n0 ttft %.2f (lower in %d/%d)" % (st.median(d), sum(x < 0 for x in d), len(d)))
asyncio.run(main())
