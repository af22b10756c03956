"""One-off: on one running front-end stack (`kvpush up --front-end`), `vllm bench serve` at
the grid's lowest load (1 QPS, 16 prompts, 16 output tokens) straight to the prefill engine
(x-kvpush-front-end: off) and through its front end, in turn, each run its own seed."""
import json, random, statistics as st, sys
from pathlib import Path
from kvpush.bench import vllm_bench
from kvpush.launch import tinymodel
N = int(sys.argv[1]); out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
tok = str(tinymodel.ensure()); url = "http://127.0.0.1:8100"
KINDS = {"direct": {"x-kvpush-front-end": "off"}, "fe": None}
vllm_bench.warm_up(url, tok, "tiny", 256, 16)
rng = random.Random(); seed = 1000; res = {}
for n_in in (256, 1024):
    for i in range(N):
        order = list(KINDS); rng.shuffle(order)
        for k in order:
            seed += 1
            r = vllm_bench.run(url, tok, "tiny", vllm_bench.Load(1.0, n_in, 16, 16, seed=seed), out / f"{k}_{n_in}_{i}.json", True, KINDS[k])
            res.setdefault(f"{k}_{n_in}", []).append(r["median_ttft_ms"])
            print(k, n_in, i, round(r["median_ttft_ms"], 1), round(r["median_tpot_ms"], 2), flush=True)
for k, v in res.items(): print(k, [round(x, 1) for x in v], "median", round(st.median(v), 1))
(out / "summary.json").write_text(json.dumps(res, indent=1))
