import asyncio, json, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]
OFF = {"x-kvpush-front-end": "off"}
KINDS = {"fe": ("http://127.0.0.1:8100", {}), "prefill": ("http://127.0.0.1:8100", OFF),
         "decode": ("http://127.0.0.1:8200", {}), "proxy": ("http://127.0.0.1:8000", {})}
async def main():
    rng = random.Random(time.time_ns()); res = {k: {"ttft": [], "itl0": [], "tpot": []} for k in KINDS}
    async with httpclient.session() as s:
        for i in range(N):
            order = list(KINDS); rng.shuffle(order)
            for kind in order:
                await asyncio.sleep(0.4)
                url, hdr = KINDS[kind]
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 64, "stream": True, "ignore_eos": True}
                t0 = time.perf_counter(); marks = []
                async with s.post(url + "/v1/completions", json=body, headers=hdr) as r:
                    async for ev in httpclient.sse_events(r):
                        if ev.get("choices"): marks.append(time.perf_counter())
                v = res[kind]
                v["ttft"].append((marks[0] - t0) * 1e3); v["itl0"].append((marks[1] - marks[0]) * 1e3)
                v["tpot"].append((marks[-1] - marks[1]) * 1e3 / (len(marks) - 2))
    json.dump(res, open(out, "w"))
    for k, v in res.items():
        print(k, " ".join(f"{m} {st.median(v[m]):.2f}" for m in v))
asyncio.run(main())
