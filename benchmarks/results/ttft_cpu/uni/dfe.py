"""One-off: on one running front-end stack, the same request straight to the prefill engine
(x-kvpush-front-end: off) and through its front end, in random order, paired.

`python dfe.py ROUNDS OUT.json [text]`: with `text`, each prompt is text (random token ids
decoded by the model's tokenizer, as `vllm bench serve`'s random dataset makes them), the
gaps are Poisson at 1/s (the grid's lowest load), and 256 tokens only (dfe_text1.json)."""
import asyncio, json, random, sys, time, statistics as st
from kvpush import httpclient
N = int(sys.argv[1]); out = sys.argv[2]; url = "http://127.0.0.1:8100"
text = sys.argv[3:] == ["text"]
if text:
    from kvpush.launch import tinymodel
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tinymodel.ensure()))
KINDS = {"direct": {"x-kvpush-front-end": "off"}, "fe": {}}
async def main():
    rng = random.Random(time.time_ns()); res = {}
    async with httpclient.session() as s:
        for n_in in (256,) if text else (256, 1024):
            r_ = res[n_in] = {k: [] for k in KINDS}
            for i in range(N + 2):
                order = list(KINDS); rng.shuffle(order)
                ids = {k: [rng.randrange(100, 1000) for _ in range(n_in)] for k in KINDS}
                if text: ids = {k: tok.decode(v) for k, v in ids.items()}
                for kind in order:
                    await asyncio.sleep(rng.expovariate(1.0) if text else 0.5)
                    body = {"model": "tiny", "prompt": ids[kind], "max_tokens": 16, "stream": True, "ignore_eos": True}
                    t0 = time.perf_counter(); times = []
                    async with s.post(url + "/v1/completions", json=body, headers=KINDS[kind]) as r:
                        async for ev in httpclient.sse_events(r):
                            if ev.get("choices"):
                                times.append(time.perf_counter())
                    if i >= 2:
                        r_[kind].append({"ttft": (times[0] - t0) * 1e3, "itl0": (times[1] - times[0]) * 1e3, "tpot": (times[-1] - times[0]) * 1e3 / max(1, len(times) - 1), "n": len(times)})
            for k, v in r_.items():
                print(n_in, k, "ttft p50 %.2f" % st.median(x["ttft"] for x in v), "itl0 p50 %.2f" % st.median(x["itl0"] for x in v), "tpot p50 %.2f" % st.median(x["tpot"] for x in v), flush=True)
            d = [a["ttft"] - b["ttft"] for a, b in zip(r_["fe"], r_["direct"])]
            print(n_in, "paired fe-direct ttft median %.2f, fe faster in %d/%d" % (st.median(d), sum(x < 0 for x in d), len(d)), flush=True)
    json.dump(res, open(out, "w"))
asyncio.run(main())
