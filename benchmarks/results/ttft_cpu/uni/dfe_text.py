"""One-off: as dfe.py, but each prompt is text (random token ids decoded by the model's
tokenizer, as `vllm bench serve`'s random dataset makes them), and the gaps are Poisson at
1/s, as the grid's lowest load."""
import asyncio, json, random, sys, time, statistics as st
from kvpush import httpclient
from kvpush.launch import tinymodel
from transformers import AutoTokenizer
N = int(sys.argv[1]); out = sys.argv[2]; url = "http://127.0.0.1:8100"
tok = AutoTokenizer.from_pretrained(str(tinymodel.ensure()))
KINDS = {"direct": {"x-kvpush-front-end": "off"}, "fe": {}}
async def main():
    rng = random.Random(time.time_ns()); res = {}
    async with httpclient.session() as s:
        for n_in in (256,):
            r_ = res[n_in] = {k: [] for k in KINDS}
            for i in range(N + 2):
                order = list(KINDS); rng.shuffle(order)
                for kind in order:
                    text = tok.decode([rng.randrange(100, 1000) for _ in range(n_in)])
                    await asyncio.sleep(rng.expovariate(1.0))
                    body = {"model": "tiny", "prompt": text, "max_tokens": 16, "stream": True, "ignore_eos": True}
                    t0 = time.perf_counter(); times = []
                    async with s.post(url + "/v1/completions", json=body, headers=KINDS[kind]) as r:
                        async for ev in httpclient.sse_events(r):
                            if ev.get("choices"):
                                times.append(time.perf_counter())
                    if i >= 2:
                        r_[kind].append({"ttft": (times[0] - t0) * 1e3, "itl0": (times[1] - times[0]) * 1e3, "n": len(times)})
            for k, v in r_.items():
                print(n_in, k, "ttft p50 %.2f" % st.median(x["ttft"] for x in v), "itl0 p50 %.2f" % st.median(x["itl0"] for x in v), flush=True)
            d = [a["ttft"] - b["ttft"] for a, b in zip(r_["fe"], r_["direct"])]
            print(n_in, "paired fe-direct ttft median %.2f, fe faster in %d/%d" % (st.median(d), sum(x < 0 for x in d), len(d)), flush=True)
    json.dump(res, open(out, "w"))
asyncio.run(main())
