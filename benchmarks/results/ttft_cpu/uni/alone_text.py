"""One-off: one plain engine (vLLM's default executor) and one kvpush prefill engine (no decode,
no transfer), alone on a core each, the same text prompt to each in turn; argv[3]: the kvpush
engine's kv_connector_extra_config as JSON."""
import asyncio, json, random, statistics as st, sys, time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from kvpush.launch.engine import Engine, EngineSpec
from kvpush.launch import tinymodel
from kvpush import httpclient
from transformers import AutoTokenizer
model = str(tinymodel.ensure()); tok = AutoTokenizer.from_pretrained(model)
out = Path(sys.argv[1]); nr = int(sys.argv[2]); extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
res = {"extra": extra, "phases": []}
async def ttft(c, url, text):
    b = {"model": "tiny", "prompt": text, "max_tokens": 16, "stream": True, "ignore_eos": True}
    t = time.perf_counter(); first = None
    async with c.post(url + "/v1/completions", json=b) as r:
        async for _ in r.content.iter_any():
            if first is None: first = (time.perf_counter() - t) * 1e3
    return first
async def rounds(urls, n_in, n):
    got = {k: [] for k in urls}
    async with httpclient.session(4) as c:
        for i in range(n + 2):
            text = tok.decode([random.randrange(100, 2000) for _ in range(n_in)])
            text = {k: text + f" {k}" for k in urls}  # not one cached prefix for both... same length
            order = list(urls); random.shuffle(order)
            for k in order:
                v = await ttft(c, urls[k], text[k])
                if i >= 2: got[k].append(v)
                await asyncio.sleep(random.expovariate(2.0))
    return got
mono = EngineSpec("mono", model, 8300, engine_id="mono-x", cpu_bind="0")
pre = EngineSpec("prefill", model, 8301, engine_id="pre-x", cpu_bind="1", side_channel_port=5790, connector_extra=extra)
engines = [Engine(mono, Path("/tmp/an/mono.log")), Engine(pre, Path("/tmp/an/pre.log"))]
try:
    with ThreadPoolExecutor(2) as p: list(p.map(lambda e: e.wait_ready(), engines))
    urls = {"mono": mono.url, "kvpush_prefill": pre.url}
    for n_in in (180, 700):
        got = asyncio.run(rounds(urls, n_in, nr))
        ph = {"n_in": n_in, "ttft_ms": got, "median": {k: st.median(v) for k, v in got.items()},
              "paired_median_diff": st.median(b - a for a, b in zip(got["mono"], got["kvpush_prefill"]))}
        res["phases"].append(ph)
        print(extra, n_in, {k: round(v, 1) for k, v in ph["median"].items()}, "paired", round(ph["paired_median_diff"], 2), flush=True)
finally:
    for e in engines: e.stop()
out.write_text(json.dumps(res, indent=1))
