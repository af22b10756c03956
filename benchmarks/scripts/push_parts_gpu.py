"""Where a contiguous push's time goes on one GPU (issue 12: contiguous >= 80 % of the raw
NIXL WRITE), for the KV of one TP-8 rank of Qwen3-32B (128 regions, 4 KiB per block per
region), contiguous blocks, 1k / 4k / 16k tokens. Medians of REPEATS after one warm-up, every
timed operation from a warm CUDA context (Memory.warm).

- raw: a NIXL WRITE with a notification, timed in the posting process in parts: the two
  descriptor lists (get_xfer_descs), initialize_xfer, transfer (the post), then spinning on
  check_xfer_state until DONE;
- push: kvpush's push through an endpoint pair (its loops poll every 0.1 ms after a post),
  with the push's own marks (plan, post, complete), from the hand-over as today's push() and
  "ahead": with the WRITE made ready first (PrefillEndpoint.prepare, as the connector does
  while prefill computes the prompt's last tokens), so that push() only posts it.

Run on a CUDA host: python benchmarks/scripts/push_parts_gpu.py OUT.json
(a trial run on DRAM: ... OUT.json cpu)
"""

import json
import statistics
import sys
from dataclasses import replace

REPEATS = 9
TOKENS = [1024, 4096, 16384]  # DRAM trial: 1024 only
VARIANTS = {"push": False, "push_ahead": True}  # name: made ready first


def main(out: str, device: str = "cuda") -> None:
    from kvpush.bench.harness import Side
    from kvpush.bench.transfer import QWEN3_32B_TP8, RawSide, _free_port, _push, push_parts_ms
    from kvpush.transfer.endpoint import TransferConfig
    from kvpush.transfer.wire import Compat, PrefillAddress

    tokens_run = TOKENS if device != "cpu" else TOKENS[:1]
    n_max = max(tokens_run) // 16
    spec = replace(QWEN3_32B_TP8, num_blocks=n_max, device=device)
    raw_p, raw_d = RawSide(spec, 1, "raw-p"), RawSide(spec, 2, "raw-d")
    remote = raw_p.call("add_remote", raw_d.metadata)
    raw_d.call("add_remote", raw_p.metadata)
    compat = Compat("push", "bench", "uint8", "bench")
    port = _free_port()
    cfg = TransferConfig("bench-prefill", compat, side_channel_port=port)
    p = Side("prefill", cfg, spec, seed=1)
    d = Side("decode", replace(cfg, engine_id="bench-decode", side_channel_port=0), spec)
    address = PrefillAddress("127.0.0.1", port)
    rows = []
    try:
        for tokens in tokens_run:
            ids = list(range(tokens // 16))
            samples: dict[str, list[float]] = {}
            for r in range(REPEATS + 1):
                raw_p.call("warm", None)
                raw = raw_p.call("op", ("WRITE_PARTS", remote, raw_d.layout, ids, ids, tokens))
                assert raw["ok"], raw
                got = {f"raw_{k}": v for k, v in raw.items() if k != "ok"}
                for name, ahead in VARIANTS.items():
                    out_p, _, _ = _push(p, d, address, ids, tokens, ahead=ahead)
                    got[f"{name}_ms"] = out_p.elapsed_s * 1e3
                    for part, ms in push_parts_ms(out_p.marks).items():
                        got[f"{name}_{part}_ms"] = ms
                if r:
                    for k, v in got.items():
                        samples.setdefault(k, []).append(v)
            row = {"num_tokens": tokens, "repeats": REPEATS}
            row |= {f"{k}_median": statistics.median(v) for k, v in samples.items()}
            rows.append(row)
            print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    finally:
        p.close()
        d.close()
        raw_p.close()
        raw_d.close()
    with open(out, "w") as f:
        json.dump({"benchmark": "push_parts_gpu", "variants": list(VARIANTS), "rows": rows}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
