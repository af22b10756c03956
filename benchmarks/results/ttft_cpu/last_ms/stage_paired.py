import asyncio, json, os, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]; flag = "/tmp/probe/nostage"; url = "http://127.0.0.1:8100"
async def main():
    rng = random.Random(time.time_ns()); res = {"stage": [[], []], "direct": [[], []]}
    async with httpclient.session() as s:
        for i in range(N):
            for kind in rng.sample(list(res), 2):
                if kind == "direct": open(flag, "w").close()
                elif os.path.exists(flag): os.remove(flag)
                for pos in (0, 1):
                    await asyncio.sleep(0.5)
                    body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                    t0 = time.perf_counter(); times = []
                    async with s.post(url + "/v1/completions", json=body) as r:
                        async for ev in httpclient.sse_events(r):
                            if ev.get("choices"):
                                times.append(time.perf_counter())
                    res[kind][pos].append({"ttft": (times[0] - t0) * 1e3, "itl0": (times[1] - times[0]) * 1e3, "tpot": (times[-1] - times[0]) * 1e3 / max(1, len(times) - 1)})
    if os.path.exists(flag): os.remove(flag)
    json.dump(res, open(out, "w"))
    for k, v in res.items():
        for pos in (0, 1):
            print(k, pos, "ttft %.2f itl0 %.2f tpot %.2f" % tuple(st.median(x[f] for x in v[pos]) for f in ("ttft", "itl0", "tpot")))
    for pos in (0, 1):
        d = [a["itl0"] - b["itl0"] for a, b in zip(res["stage"][pos], res["direct"][pos])]
        e = [a["ttft"] - b["ttft"] for a, b in zip(res["stage"][pos], res["direct"][pos])]
        print("pos %d stage-direct itl0 %.2f (lower in %d/%d) ttft %.2f" % (pos, st.median(d), sum(x < 0 for x in d), len(d), st.median(e)))
asyncio.run(main())
