import asyncio, os, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); FE = int(sys.argv[2]); EC = int(sys.argv[3]); WK = int(sys.argv[4])
TCK = os.sysconf("SC_CLK_TCK")
def cpu_threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            ns = int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
        except FileNotFoundError:
            continue
        out[(t, name)] = ns / 1e6
    return out
def delta(a, b):
    d = {}
    for k, v in b.items():
        x = v - a.get(k, 0)
        if x > 0: d[k[1] + ':' + k[0]] = d.get(k[1] + ':' + k[0], 0) + x
    return d
async def main():
    rng = random.Random(time.time_ns()); acc = {"direct": [], "front": []}
    async with httpclient.session() as s:
        for i in range(N):
            for kind in rng.sample(["direct", "front"], 2):
                hdr = {"x-kvpush-front-end": "off"} if kind == "direct" else {}
                await asyncio.sleep(0.5)
                b = (cpu_threads(FE), cpu_threads(EC), cpu_threads(WK))
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "max_tokens": 16, "stream": True, "ignore_eos": True}
                async with s.post("http://127.0.0.1:8100/v1/completions", json=body, headers=hdr) as r:
                    async for ev in httpclient.sse_events(r):
                        pass
                await asyncio.sleep(0.2)
                a = (cpu_threads(FE), cpu_threads(EC), cpu_threads(WK))
                acc[kind].append(tuple(delta(x, y) for x, y in zip(b, a)))
    for k, v in acc.items():
        for i, label in enumerate(("front-end", "engine core", "worker")):
            tot = {}
            for tup in v:
                for n, x in tup[i].items(): tot[n] = tot.get(n, 0) + x
            print(k, label, {n: round(x / len(v), 3) for n, x in sorted(tot.items(), key=lambda z: -z[1]) if x / len(v) > 0.02})
asyncio.run(main())
