import asyncio, json, random, subprocess, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]; pid = sys.argv[3]; url = sys.argv[4] if len(sys.argv) > 4 else "http://127.0.0.1:8100"
KINDS = {"float": "0,1", "core1": "1"}
def setaff(cores):
    subprocess.run(["taskset", "-a", "-p", "-c", cores, pid], check=True, stdout=subprocess.DEVNULL)
async def main():
    rng = random.Random(time.time_ns()); res = {k: [] for k in KINDS}
    async with httpclient.session() as s:
        for i in range(N):
            order = list(KINDS); rng.shuffle(order)
            for kind in order:
                setaff(KINDS[kind])
                await asyncio.sleep(0.5)
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                t0 = time.perf_counter(); times = []
                async with s.post(url + "/v1/completions", json=body) as r:
                    async for ev in httpclient.sse_events(r):
                        if ev.get("choices"):
                            times.append(time.perf_counter())
                res[kind].append({"ttft": (times[0] - t0) * 1e3, "itl0": (times[1] - times[0]) * 1e3, "tpot": (times[-1] - times[0]) * 1e3 / max(1, len(times) - 1), "n": len(times)})
    setaff("0,1")
    json.dump(res, open(out, "w"))
    for k, v in res.items():
        print(k, "ttft p50 %.2f" % st.median(x["ttft"] for x in v), "itl0 p50 %.2f" % st.median(x["itl0"] for x in v), "tpot p50 %.2f" % st.median(x["tpot"] for x in v), "n", len(v))
    for k in ("core1",):
        d = [a["ttft"] - b["ttft"] for a, b in zip(res[k], res["float"])]
        e = [a["itl0"] - b["itl0"] for a, b in zip(res[k], res["float"])]
        print("%s-float ttft paired %.2f (lower in %d/%d) itl0 %.2f" % (k, st.median(d), sum(x < 0 for x in d), len(d), st.median(e)))
asyncio.run(main())
