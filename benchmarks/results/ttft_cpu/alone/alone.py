"""One-off: does a kvpush prefill engine (NIXL agent loaded, KV registered) compute a prompt
as fast as a plain engine? Both alone on a core each, requests straight, no transfer.

`python alone.py OUT.json [ENV_JSON]`: ENV_JSON, environment variables for the kvpush engine
only (not used for alone1.json). docs/benchmarks.md, "Stacks in turn"."""
import asyncio, json, os, random, statistics as st, sys, time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from kvpush.launch.engine import Engine, EngineSpec
from kvpush.launch import tinymodel
from kvpush import httpclient

model = str(tinymodel.ensure())
out = Path(sys.argv[1]); env_extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
res = {"env": env_extra, "phases": []}

async def ttft(c, url, ids):
    b = {"model": "tiny", "prompt": ids, "max_tokens": 2, "stream": True, "ignore_eos": True}
    t = time.perf_counter()
    async with c.post(url + "/v1/completions", json=b) as r:
        async for _ in r.content.iter_any():
            return (time.perf_counter() - t) * 1e3

async def rounds(urls, n_in, n):
    got = {k: [] for k in urls}
    async with httpclient.session(4) as c:
        for i in range(n + 2):
            ids = [random.randrange(100, 2000) for _ in range(n_in)]
            order = list(urls); random.shuffle(order)
            for k in order:
                v = await ttft(c, urls[k], ids)
                if i >= 2: got[k].append(v)
                await asyncio.sleep(0.4)
    return got

for mono_core, kv_core in (("0", "1"), ("1", "0")):
    mono = EngineSpec("mono", model, 8300, engine_id="mono-x", cpu_bind=mono_core)
    pre = EngineSpec("prefill", model, 8301, engine_id="pre-x", cpu_bind=kv_core, side_channel_port=5790)
    saved = dict(os.environ)
    engines = [Engine(mono, Path("/tmp/an/mono.log"))]
    os.environ.update(env_extra)
    engines.append(Engine(pre, Path("/tmp/an/pre.log")))
    os.environ.clear(); os.environ.update(saved)
    try:
        with ThreadPoolExecutor(2) as p: list(p.map(lambda e: e.wait_ready(), engines))
        urls = {"mono": mono.url, "kvpush_prefill": pre.url}
        for n_in in (256, 1024):
            got = asyncio.run(rounds(urls, n_in, 20))
            ph = {"mono_core": mono_core, "n_in": n_in, "ttft_ms": got,
                  "median": {k: st.median(v) for k, v in got.items()},
                  "paired_median_diff": st.median(b - a for a, b in zip(got["mono"], got["kvpush_prefill"]))}
            res["phases"].append(ph)
            print(mono_core, n_in, ph["median"], "paired diff", round(ph["paired_median_diff"], 2), flush=True)
    finally:
        for e in engines: e.stop()
out.write_text(json.dumps(res, indent=1))
