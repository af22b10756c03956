"""Where a contiguous push's time goes on one GPU (issue 12: contiguous >= 80 % of the raw
NIXL WRITE), for the KV of one TP-8 rank of Qwen3-32B (128 regions, 4 KiB per block per
region), contiguous blocks, 1k / 4k / 16k tokens. Medians of REPEATS after one warm-up, every
timed operation from a warm CUDA context (Memory.warm).

- raw: a NIXL WRITE with a notification, timed in the posting process in parts: the two
  descriptor lists (get_xfer_descs), initialize_xfer, transfer (the post), then spinning on
  check_xfer_state until DONE;
- push at each fast poll step: kvpush's push through an endpoint pair whose loops poll every
  FAST_POLL_S after a post, with the push's own marks (plan, post, complete).

Run on a CUDA host: python benchmarks/scripts/push_parts_gpu.py OUT.json
(a trial run on DRAM: ... OUT.json cpu)
"""

import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import replace

REPEATS = 9
TOKENS = [1024, 4096, 16384]  # DRAM trial: 1024 only
FAST_POLL_S = [0.0001, 0.00002]  # the default, and a finer step


def _raw_child(conn, spec, seed, name):
    from kvpush.transfer.agent import Agent
    from kvpush.transfer.harness import Memory
    from kvpush.transfer.layout import plan_copies

    memory = Memory(spec, seed)
    layout = spec.build(memory.addresses())
    agent = Agent(name)
    agent.register(layout)
    conn.send((agent.metadata(), layout))
    while True:
        if not conn.poll(0.001):
            agent.notifs()
            continue
        cmd, args = conn.recv()
        if cmd == "close":
            agent.close()
            return
        if cmd == "add_remote":
            conn.send(agent.add_remote(args))
        elif cmd == "warm":
            memory.warm()
            conn.send(None)
        else:  # a WRITE in parts
            remote, remote_layout, ids, tokens = args
            nixl = agent._agent
            t0 = time.perf_counter()
            plan = plan_copies(layout, remote_layout, ids, ids, 0, tokens)
            src, dst = plan.descs(0, 0)
            t1 = time.perf_counter()
            local = nixl.get_xfer_descs(src, layout.mem_type)
            far = nixl.get_xfer_descs(dst, layout.mem_type)
            t2 = time.perf_counter()
            handle = nixl.initialize_xfer("WRITE", local, far, remote, b"n" * 48)
            t3 = time.perf_counter()
            state = nixl.transfer(handle)
            t4 = time.perf_counter()
            while state == "PROC":
                state = nixl.check_xfer_state(handle)
            t5 = time.perf_counter()
            nixl.release_xfer_handle(handle)
            conn.send(
                {
                    "ok": state == "DONE",
                    "plan_ms": (t1 - t0) * 1e3,
                    "descs_ms": (t2 - t1) * 1e3,
                    "init_ms": (t3 - t2) * 1e3,
                    "transfer_ms": (t4 - t3) * 1e3,
                    "complete_ms": (t5 - t4) * 1e3,
                    "total_ms": (t5 - t2) * 1e3,
                }
            )


def main(out: str, device: str = "cuda") -> None:
    from kvpush.bench.transfer import QWEN3_32B_TP8, _free_port, _push
    from kvpush.transfer.endpoint import TransferConfig
    from kvpush.transfer.harness import Side
    from kvpush.transfer.receiver import PrefillAddress
    from kvpush.transfer.wire import Compat

    ctx = mp.get_context("spawn")
    n_max = (max(TOKENS) if device != "cpu" else TOKENS[0]) // 16
    spec = replace(QWEN3_32B_TP8, num_blocks=n_max, device=device)
    raws = []
    for seed, name in ((1, "raw-p"), (2, "raw-d")):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_raw_child, args=(child, spec, seed, name), daemon=True)
        proc.start()
        raws.append((parent, proc, *parent.recv()))
    (cp, _, meta_p, lay_p), (cd, _, meta_d, lay_d) = raws
    cp.send(("add_remote", meta_d))
    remote = cp.recv()
    cd.send(("add_remote", meta_p))
    cd.recv()
    compat = Compat("push", "bench", "uint8", "bench")
    pairs = {}
    for step in FAST_POLL_S:
        port = _free_port()
        cfg = TransferConfig("bench-prefill", compat, side_channel_port=port, fast_poll_s=step)
        pairs[step] = (
            Side("prefill", cfg, spec, seed=1),
            Side("decode", replace(cfg, engine_id="bench-decode", side_channel_port=0), spec),
            PrefillAddress("127.0.0.1", port),
        )
    rows = []
    try:
        for tokens in TOKENS if device != "cpu" else TOKENS[:1]:
            ids = list(range(tokens // 16))
            samples: dict[str, list[float]] = {}
            for r in range(REPEATS + 1):
                cp.send(("warm", None))
                cp.recv()
                cp.send(("write", (remote, lay_d, ids, tokens)))
                raw = cp.recv()
                assert raw["ok"], raw
                got = {f"raw_{k}": v for k, v in raw.items() if k != "ok"}
                for step, (p, d, address) in pairs.items():
                    out_p, _, _ = _push(p, d, address, ids, tokens)
                    m = out_p.marks
                    got[f"push_{step}_ms"] = out_p.elapsed_s * 1e3
                    got[f"push_{step}_plan_ms"] = (m["planned"] - m["handed"]) * 1e3
                    got[f"push_{step}_post_ms"] = (m["posted"] - m["planned"]) * 1e3
                    got[f"push_{step}_complete_ms"] = (m["written"] - m["posted"]) * 1e3
                if r:
                    for k, v in got.items():
                        samples.setdefault(k, []).append(v)
            row = {"num_tokens": tokens, "repeats": REPEATS}
            row |= {f"{k}_median": statistics.median(v) for k, v in samples.items()}
            rows.append(row)
            print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    finally:
        for p, d, _ in pairs.values():
            p.close()
            d.close()
        for conn, proc, *_ in raws:
            conn.send(("close", None))
            proc.join(timeout=10)
    with open(out, "w") as f:
        json.dump({"benchmark": "push_parts_gpu", "fast_poll_s": FAST_POLL_S, "rows": rows}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
