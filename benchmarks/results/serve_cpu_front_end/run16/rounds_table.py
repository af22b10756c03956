"""The per-round table and pooled medians of a `kvpush bench serve --rounds` run of mono, the
front end and the proxy at 1 QPS: `python rounds_table.py RESULTS_DIR` (docs/benchmarks.md,
"Stacks in turn")."""
import json, statistics as st, glob, sys
D = sys.argv[1]
modes = ["mono", "kvpush-front-end", "kvpush"]
rows = []
for n_in in (256, 1024):
    for it in range(10):  # the rounds' iteration numbers
        got = {}
        for m in modes:
            try:
                got[m] = json.load(open(f"{D}/{m}_qps1_in{n_in}_out16_iter{it}.json"))
            except FileNotFoundError:
                pass
        if len(got) < 3:
            continue
        t = {m: got[m]["median_ttft_ms"] for m in modes}
        i0 = {m: st.median(x[0] * 1e3 for x in got[m]["itls"] if x) for m in modes}
        tp = {m: got[m]["median_tpot_ms"] for m in modes}
        print(f"| {it} | {n_in} | {t['mono']:.1f} | {t['kvpush-front-end']:.1f} | {t['kvpush-front-end']/t['mono']:.2f}x | {t['kvpush']:.1f} | {t['kvpush']/t['mono']:.2f}x | {i0['mono']:.1f} / {i0['kvpush-front-end']:.1f} / {i0['kvpush']:.1f} | {tp['mono']:.2f} / {tp['kvpush-front-end']:.2f} / {tp['kvpush']:.2f} |")
    # pooled and geometric mean of ratios
    pooled = {}
    for m in modes:
        xs = []
        for f in sorted(glob.glob(f"{D}/{m}_qps1_in{n_in}_out16_iter*.json")):
            xs += json.load(open(f))["ttfts"]
        pooled[m] = st.median(xs) * 1e3
    print(f"pooled {n_in}:", {m: round(v, 1) for m, v in pooled.items()},
          "FE/mono %.2f proxy/mono %.2f" % (pooled['kvpush-front-end']/pooled['mono'], pooled['kvpush']/pooled['mono']))
