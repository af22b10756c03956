import asyncio, json, os, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]; flag = sys.argv[3]; url = "http://127.0.0.1:8100"
KINDS = {"on": True, "off": False, "direct": None}  # on: flag file present
async def main():
    rng = random.Random(time.time_ns()); res = {k: [] for k in KINDS}
    async with httpclient.session() as s:
        for i in range(N):
            order = list(KINDS); rng.shuffle(order)
            for kind in order:
                if KINDS[kind]: open(flag, "w").close()
                elif os.path.exists(flag): os.remove(flag)
                hdr = {"x-kvpush-front-end": "off"} if kind == "direct" else {}
                await asyncio.sleep(0.5)
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                t0 = time.perf_counter(); times = []
                async with s.post(url + "/v1/completions", json=body, headers=hdr) as r:
                    async for ev in httpclient.sse_events(r):
                        if ev.get("choices"):
                            times.append(time.perf_counter())
                res[kind].append({"ttft": (times[0] - t0) * 1e3, "itl0": (times[1] - times[0]) * 1e3, "tpot": (times[-1] - times[0]) * 1e3 / max(1, len(times) - 1), "n": len(times)})
    if os.path.exists(flag): os.remove(flag)
    json.dump(res, open(out, "w"))
    for k, v in res.items():
        print(k, "ttft p50 %.2f" % st.median(x["ttft"] for x in v), "itl0 p50 %.2f" % st.median(x["itl0"] for x in v), "tpot p50 %.2f" % st.median(x["tpot"] for x in v), "n", len(v))
    for a, b in (("on", "off"), ("off", "direct"), ("on", "direct")):
        d = [x["ttft"] - y["ttft"] for x, y in zip(res[a], res[b])]
        e = [x["itl0"] - y["itl0"] for x, y in zip(res[a], res[b])]
        print("%s-%s ttft paired median %.2f (%s lower in %d/%d), itl0 %.2f" % (a, b, st.median(d), a, sum(x < 0 for x in d), len(d), st.median(e)))
asyncio.run(main())
