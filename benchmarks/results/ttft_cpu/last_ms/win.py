import asyncio, json, random, sys, time, re, statistics as st
from kvpush import httpclient
N = int(sys.argv[1])
NAMES = ["vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds", "vllm:request_inference_time_seconds"]
async def metrics(s):
    async with s.get("http://127.0.0.1:8100/metrics") as r:
        text = await r.text()
    out = {}
    for n in NAMES:
        m1 = re.search(re.escape(n) + r"_sum\{[^}]*\} ([0-9.e+-]+)", text); m2 = re.search(re.escape(n) + r"_count\{[^}]*\} ([0-9.e+-]+)", text)
        out[n] = (float(m1.group(1)), float(m2.group(1)))
    return out
KINDS = {"stream16": ({"stream": True, "max_tokens": 16}, {"x-kvpush-front-end": "off"}),
         "plain1": ({"stream": False, "max_tokens": 1}, {"x-kvpush-front-end": "off"}),
         "front": ({"stream": True, "max_tokens": 16}, {})}
async def main():
    rng = random.Random(time.time_ns()); acc = {k: {} for k in KINDS}
    async with httpclient.session() as s:
        for i in range(N):
            for kind in rng.sample(list(KINDS), len(KINDS)):
                extra, hdr = KINDS[kind]
                await asyncio.sleep(0.5)
                before = await metrics(s)
                await asyncio.sleep(0.05)
                body = {"model": "tiny", "prompt": [rng.randrange(100, 1000) for _ in range(256)], "ignore_eos": True} | extra
                async with s.post("http://127.0.0.1:8100/v1/completions", json=body, headers=hdr) as r:
                    await r.read()
                await asyncio.sleep(0.3)
                after = await metrics(s)
                for n in NAMES:
                    ds, dc = after[n][0] - before[n][0], after[n][1] - before[n][1]
                    if dc == 1: acc[kind].setdefault(n, []).append(ds * 1e3)
    for k in acc:
        print(k, {n.split(":")[1]: (round(st.median(v), 2), len(v)) for n, v in acc[k].items()})
asyncio.run(main())
