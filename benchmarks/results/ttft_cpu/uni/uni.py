"""One-off: a plain engine with vLLM's in-process executor (VLLM_ENABLE_V1_MULTIPROCESSING=0,
--distributed-executor-backend uni) against the default (mp), alone on a core each.

`python uni.py OUT.json [ROUNDS] [text]`: with `text`, each prompt is text (the random ids
decoded by the tiny model's tokenizer: more tokens than asked), and the first core order only
(uni_text1.json; uni1.json without it)."""
import asyncio, json, os, random, statistics as st, sys, time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from kvpush.launch.engine import Engine, EngineSpec
from kvpush.launch import tinymodel
from kvpush import httpclient
import psutil

model = str(tinymodel.ensure())
out = Path(sys.argv[1]); nr = int(sys.argv[2]) if len(sys.argv) > 2 else 12
text = sys.argv[3:] == ["text"]
if text:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
res = {"phases": []}

async def ttft(c, url, ids):
    b = {"model": "tiny", "prompt": ids, "max_tokens": 16, "stream": True, "ignore_eos": True}
    t = time.perf_counter(); first = None
    async with c.post(url + "/v1/completions", json=b) as r:
        async for _ in r.content.iter_any():
            if first is None: first = (time.perf_counter() - t) * 1e3
    return first, (time.perf_counter() - t) * 1e3

def tree_cpu(pid):
    p = psutil.Process(pid); ps = [p] + p.children(recursive=True)
    s = 0.0
    for q in ps:
        try: c = q.cpu_times(); s += c.user + c.system
        except psutil.Error: pass
    return s

async def rounds(urls, pids, n_in, n):
    got = {k: [] for k in urls}; tot = {k: [] for k in urls}; cpu = {k: [] for k in urls}
    async with httpclient.session(4) as c:
        for i in range(n + 2):
            ids = [random.randrange(100, 2000) for _ in range(n_in)]
            if text: ids = tok.decode(ids)
            order = list(urls); random.shuffle(order)
            for k in order:
                c0 = tree_cpu(pids[k])
                v, t = await ttft(c, urls[k], ids)
                await asyncio.sleep(0.4)
                c1 = tree_cpu(pids[k])
                if i >= 2: got[k].append(v); tot[k].append(t); cpu[k].append(c1 - c0)
    return got, tot, cpu

for a_core, b_core in (("0", "1"),) if text else (("0", "1"), ("1", "0")):
    a = EngineSpec("mono", model, 8300, engine_id="mono-mp", cpu_bind=a_core)
    b = EngineSpec("mono", model, 8301, engine_id="mono-uni", cpu_bind=b_core,
                   extra_args=("--distributed-executor-backend", "uni"))
    saved = dict(os.environ)
    engines = [Engine(a, Path("/tmp/an/mp.log"))]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engines.append(Engine(b, Path("/tmp/an/uni.log")))
    os.environ.clear(); os.environ.update(saved)
    try:
        with ThreadPoolExecutor(2) as p: list(p.map(lambda e: e.wait_ready(), engines))
        time.sleep(2)
        urls = {"mp": a.url, "uni": b.url}
        pids = {"mp": engines[0].proc.pid, "uni": engines[1].proc.pid}
        idle = {k: tree_cpu(v) for k, v in pids.items()}; time.sleep(3)
        idle = {k: (tree_cpu(v) - idle[k]) / 3 for k, v in pids.items()}
        print("idle cores", idle, flush=True)
        for n_in in (256, 1024):
            got, tot, cpu = asyncio.run(rounds(urls, pids, n_in, nr))
            ph = {"a_core": a_core, "n_in": n_in, "ttft_ms": got, "total_ms": tot, "cpu_s": cpu, "idle": idle,
                  "median": {k: st.median(v) for k, v in got.items()},
                  "median_total": {k: st.median(v) for k, v in tot.items()},
                  "median_cpu": {k: st.median(v) for k, v in cpu.items()},
                  "paired_median_diff": st.median(b - a for a, b in zip(got["mp"], got["uni"]))}
            res["phases"].append(ph)
            print(a_core, n_in, ph["median"], ph["median_total"], ph["median_cpu"], "paired", round(ph["paired_median_diff"], 2), flush=True)
    finally:
        for e in engines: e.stop()
out.write_text(json.dumps(res, indent=1))
