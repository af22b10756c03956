import asyncio, json, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]
OFF = {"x-kvpush-front-end": "off"}
KINDS = {"direct": OFF, "fe": {}}
async def main():
    rng = random.Random(time.time_ns()); res = {k: {"ttft": [], "itl0": [], "tpot": []} for k in KINDS}
    async with httpclient.session() as s:
        for i in range(N):
            order = list(KINDS); rng.shuffle(order)
            for kind in order:
                await asyncio.sleep(0.4)
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                t0 = time.perf_counter(); marks = []
                async with s.post("http://127.0.0.1:8100/v1/completions", json=body, headers=KINDS[kind]) as r:
                    async for ev in httpclient.sse_events(r):
                        if ev.get("choices"): marks.append(time.perf_counter())
                v = res[kind]
                v["ttft"].append((marks[0] - t0) * 1e3); v["itl0"].append((marks[1] - marks[0]) * 1e3)
                v["tpot"].append((marks[-1] - marks[0]) * 1e3 / (len(marks) - 1))
    json.dump(res, open(out, "w"))
    for k, v in res.items():
        print(k, " ".join(f"{m} {st.median(v[m]):.2f}" for m in v))
    d = [x - y for x, y in zip(res["fe"]["ttft"], res["direct"]["ttft"])]
    print(f"fe-direct ttft paired median {st.median(d):+.2f}; ratio of medians {st.median(res['fe']['ttft'])/st.median(res['direct']['ttft']):.3f}")
asyncio.run(main())
