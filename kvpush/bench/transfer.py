"""`kvpush bench transfer`: push vs a pull baseline vs a raw NIXL WRITE, over DRAM or VRAM.

Six child processes per KV shape (eight with `--device cuda`): two pairs of prefill and
decode endpoints (the push path, with and without the fast poll step; on CUDA a third pair
with staging off), and two raw NIXL agents (the pull baseline and the
raw WRITE). Per grid point, medians of several repeats:
- push_ms: prefill hands its blocks over (both sides ready: decode registered first) until
  the WRITE completed and the blocks may be freed; measured inside the prefill process;
- pull_ms: decode learns the block ids, builds descriptors on its caller thread, posts a
  READ and polls it to completion, as a pull connector does after prefill;
- push_1ms_step_ms: the same push through a second endpoint pair whose loops keep the 1 ms
  busy step after a WRITE is posted (`fast_poll_s=0`), in the same run;
- push_plan_ms / push_post_ms / push_complete_ms: the push's own parts, hand-over -> copy
  plan and descriptors built -> WRITE posted -> WRITE complete;
- raw_write_ms: one WRITE of the same bytes with descriptors built beforehand;
  raw_write_notif_ms: the same with a notification, as the push's WRITEs carry, right after
  it; with `--device cuda`, every timed push and raw op starts from a warm CUDA context
  (harness.Memory.warm), and raw_write_cold_ms is a WRITE with a notification that is not
  warmed, the first in its process after the other process's READ;
- descs: descriptors posted; caller_blocked_ms: how long the caller's thread was held
  (push: enqueue only; pull: descriptor build and post);
- d2d_copy_ms (CUDA only): one device-to-device copy of the same number of bytes on the one
  GPU, the ceiling for any transfer between two processes on it.
- with `--device cuda`: push_ms is the default, which stages a push whose plan has 512+
  descriptors (kvpush.transfer.staging; push_gather_ms / push_scatter_ms are its copies,
  hand-over -> gathered on prefill, landed -> scattered on decode), and push_direct_ms the
  same push through a third endpoint pair with staging off, in the same run;
  push_landed_ms / push_direct_landed_ms: from prefill's hand-over until decode counts the
  data landed (for a staged push, after its scatter): what the request waits for;
- with `--device cuda`, the candidates for scattered blocks (issue 12), on the same blocks:
  raw_prepped_write_ms (NIXL's prepared descriptor lists, prepared untimed),
  gather_ms / scatter_ms (a staged transfer's device steps, one batched-copy kernel), and
  staged_estimate_ms (gather + the contiguous raw WRITE of the same bytes + scatter).

Shapes: on DRAM, one region with block sizes from 4 KiB to 1 MiB; with `--device cuda`, the
KV of one tensor-parallel rank of Qwen3-32B at TP 8 (64 layers, K and V in separate
regions, 1 KV head of 128 in bf16, 16-token blocks: 4 KiB per block per region) for
prompts of 1k, 4k and 16k tokens, twice: each region its own tensor (layer-outer), then
every region's block side by side in one buffer (cross-layer, vLLM's block-outer layouts;
rows with `cross_layer: true`), where a run of blocks is one descriptor for all regions.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpush.bench.harness import LayoutSpec, Side

KIB = 1024
FULL_GRID = {"block_bytes": [4 * KIB, 64 * KIB, 1024 * KIB], "num_blocks": [1, 16, 256, 4096]}
QUICK_GRID = {"block_bytes": [4 * KIB, 1024 * KIB], "num_blocks": [1, 64]}
MAX_POINT_BYTES = 256 * 1024 * KIB  # skip points above this: DRAM on a 2-core, 24 GiB host
TOKENS_PER_BLOCK = 16
# One TP-8 rank of Qwen3-32B: 64 layers x (K, V), 1 KV head of 128 bf16 values per token.
QWEN3_32B_TP8 = LayoutSpec(
    num_blocks=0,  # set per run
    block_size=16,
    num_heads=1,
    head_bytes=128 * 2,
    num_regions=64 * 2,
    elem_bytes=2,
    device="cuda",
)
CUDA_TOKENS = {"full": [1024, 4096, 16384], "quick": [1024]}


def _raw_child(conn: Any, spec: LayoutSpec, seed: int, name: str) -> None:
    from kvpush.bench.harness import Memory
    from kvpush.transfer.agent import Agent
    from kvpush.transfer.layout import plan_copies

    memory = Memory(spec, seed)
    layout = spec.build(memory.addresses())
    agent = Agent(name)
    agent.register(layout)
    conn.send((agent.metadata(), layout))
    while True:
        if not conn.poll(0.001):
            agent.notifs()  # the passive side must make progress on TCP
            continue
        cmd, args = conn.recv()
        if cmd == "close":
            agent.close()
            return
        if cmd == "add_remote":
            conn.send(agent.add_remote(args))
            continue
        if cmd == "warm":
            memory.warm()
            conn.send(None)
            continue
        op, remote, remote_layout, src_ids, dst_ids, num_tokens = args
        if op in ("GATHER", "SCATTER"):
            conn.send(
                _staging_copy(op, memory, layout, remote_layout, src_ids, dst_ids, num_tokens)
            )
            continue
        if op == "WRITE_PARTS":
            conn.send(_write_parts(agent, remote, layout, remote_layout, src_ids, num_tokens))
            continue
        if op == "WRITE_PREPPED":
            plan = plan_copies(layout, remote_layout, src_ids, dst_ids, 0, num_tokens)
            conn.send(_prepped_write(agent, remote, plan, layout.mem_type))
            continue
        t0 = time.perf_counter()
        if op == "READ":  # pull: the remote holds the source
            plan = plan_copies(remote_layout, layout, src_ids, dst_ids, 0, num_tokens)
            remote_descs, local_descs = plan.descs(0, 0)
        else:
            plan = plan_copies(layout, remote_layout, src_ids, dst_ids, 0, num_tokens)
            local_descs, remote_descs = plan.descs(0, 0)
        t_built = time.perf_counter()
        notif = b""
        if op in ("WRITE", "WRITE_NOTIF", "WRITE_COLD"):
            t0 = t_built  # raw WRITE: descriptors are prepared ahead, not timed
        if op in ("WRITE_NOTIF", "WRITE_COLD"):  # the push's notification, as a WrittenMsg
            op, notif = "WRITE", b"n" * 48
        mem = layout.mem_type
        handle = agent.initialize(op, remote, local_descs, remote_descs, mem, mem, notif)
        state = agent.start(handle, notif)
        t_posted = time.perf_counter()
        while state == "PROC":
            state = agent.state(handle)
        t_done = time.perf_counter()
        agent.release(handle)
        conn.send(
            {
                "ok": state == "DONE",
                "total_ms": (t_done - t0) * 1e3,
                "caller_blocked_ms": (t_posted - t0) * 1e3,
                "descs": plan.num_descs,
            }
        )


def _write_parts(
    agent: Any, remote: str, layout: Any, remote_layout: Any, ids: list, num_tokens: int
) -> dict:
    """A WRITE with a notification timed in parts, as a caller of NIXL does it: the copy plan
    and descriptors, the two descriptor lists, initialize_xfer, transfer (the post), then
    check_xfer_state in a tight loop until done. `total_ms` leaves the plan out."""
    from kvpush.transfer.layout import plan_copies

    nixl, mem = agent._agent, layout.mem_type  # the parts Agent.initialize and Agent.start do
    t0 = time.perf_counter()
    src, dst = plan_copies(layout, remote_layout, ids, ids, 0, num_tokens).descs(0, 0)
    t1 = time.perf_counter()
    local, far = nixl.get_xfer_descs(src, mem), nixl.get_xfer_descs(dst, mem)
    t2 = time.perf_counter()
    handle = nixl.initialize_xfer("WRITE", local, far, remote, b"n" * 48)
    t3 = time.perf_counter()
    state = nixl.transfer(handle)
    t4 = time.perf_counter()
    while state == "PROC":
        state = nixl.check_xfer_state(handle)
    t5 = time.perf_counter()
    nixl.release_xfer_handle(handle)
    parts = {"plan": (t0, t1), "descs": (t1, t2), "init": (t2, t3), "transfer": (t3, t4)}
    parts |= {"complete": (t4, t5), "total": (t1, t5)}
    return {"ok": state == "DONE"} | {f"{k}_ms": (b - a) * 1e3 for k, (a, b) in parts.items()}


def _prepped_write(agent: Any, remote: str, plan: Any, mem: str) -> dict:
    """Candidate: NIXL's prepared descriptor lists. Both lists are prepared beforehand (a
    connector would do it once per registration); timed: the WRITE by index, post,
    completion."""
    import numpy as np

    local_descs, remote_descs = plan.descs(0, 0)
    local, far = agent.prep(None, local_descs, mem), agent.prep(remote, remote_descs, mem)
    t0 = time.perf_counter()
    handle, state = agent.post_prepped(
        "WRITE", local, far, np.arange(plan.num_descs, dtype=np.int32)
    )
    while state == "PROC":
        state = agent.state(handle)
    total_ms = (time.perf_counter() - t0) * 1e3
    agent.release(handle)
    agent.release_prepped(local)
    agent.release_prepped(far)
    return {"ok": state == "DONE", "total_ms": total_ms, "descs": plan.num_descs}


def _staging_copy(
    op: str, memory: Any, local: Any, remote: Any, src_ids: list, dst_ids: list, num_tokens: int
) -> dict:
    """Candidate: a staged transfer's device-side steps, on this process's GPU. GATHER packs
    the prefill rows of the copy plan into one staging buffer (prefill's step before one
    contiguous WRITE); SCATTER unpacks a staging buffer into the decode rows (decode's step
    after it). One kernel launch (kvpush.transfer.batchcopy), timed with CUDA events."""
    import numpy as np
    import torch

    from kvpush.transfer.batchcopy import copy_rows
    from kvpush.transfer.layout import plan_copies

    if op == "GATHER":
        plan = plan_copies(local, remote, src_ids, dst_ids, 0, num_tokens)
        rows = plan.src_addrs
    else:
        plan = plan_copies(remote, local, src_ids, dst_ids, 0, num_tokens)
        rows = plan.dst_addrs
    staging = torch.empty(plan.total_bytes, dtype=torch.uint8, device="cuda")
    offsets = np.concatenate([[0], np.cumsum(plan.num_bytes)[:-1]])
    packed = staging.data_ptr() + offsets
    src, dst = (rows, packed) if op == "GATHER" else (packed, rows)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    copy_rows(src, dst, plan.num_bytes)
    end.record()
    end.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    ok = True
    if op == "GATHER":  # byte-exact against torch, for the first and last rows
        bases = [b.data_ptr() for b in memory.buffers]
        for i in (0, plan.num_descs - 1):
            addr, n, o = int(rows[i]), int(plan.num_bytes[i]), int(offsets[i])
            k = max((b, k) for k, b in enumerate(bases) if b <= addr)[1]  # its buffer
            want = memory.buffers[k][addr - bases[k] :][:n]
            ok = ok and bool(torch.equal(want, staging[o : o + n]))
    return {"ok": ok, "kernel_ms": start.elapsed_time(end), "wall_ms": wall_ms}


class RawSide:
    def __init__(self, spec: LayoutSpec, seed: int, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_raw_child, args=(child, spec, seed, name), daemon=True)
        self.proc.start()
        self.metadata, self.layout = self.conn.recv()

    def call(self, cmd: str, args: Any) -> Any:
        self.conn.send((cmd, args))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("close", None))
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


def _block_ids(num_blocks: int, pattern: str) -> list[int]:
    step = 2 if pattern == "fragmented" else 1
    return list(range(0, num_blocks * step, step))


def _d2d_copy_ms(num_bytes: int, repeats: int) -> float:
    """Median time of one device-to-device copy of `num_bytes` on GPU 0 (CUDA events)."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for r in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if r:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _run_shape(spec: LayoutSpec, counts: list[int], repeats: int) -> list[dict]:
    """Every grid point for one KV shape; `spec.num_blocks` is sized here."""
    from kvpush.transfer.endpoint import TransferConfig
    from kvpush.transfer.wire import Compat, PrefillAddress

    block_bytes = spec.block_bytes
    limit = MAX_POINT_BYTES if spec.device == "cpu" else 1 << 40
    counts = [n for n in counts if n * block_bytes * spec.num_regions <= limit]
    if not counts:
        return []
    spec = replace(spec, num_blocks=2 * max(counts))  # room for the fragmented pattern
    compat = Compat("push", "bench", "uint8", "bench")
    port, port_1ms = _free_port(), _free_port()
    cfg = TransferConfig("bench-prefill", compat, side_channel_port=port)
    prefill = Side("prefill", cfg, spec, seed=1)
    decode = Side("decode", replace(cfg, engine_id="bench-decode", side_channel_port=0), spec)
    slow = replace(cfg, fast_poll_s=0.0, side_channel_port=port_1ms)
    prefill_1ms = Side("prefill", slow, spec, seed=1)
    decode_1ms = Side("decode", replace(slow, engine_id="bench-decode", side_channel_port=0), spec)
    raw_p, raw_d = RawSide(spec, 1, "raw-prefill"), RawSide(spec, 2, "raw-decode")
    raw_d_name = raw_p.call("add_remote", raw_d.metadata)
    raw_p_name = raw_d.call("add_remote", raw_p.metadata)
    address = PrefillAddress("127.0.0.1", port)
    pairs = {
        "push": (prefill, decode, address),
        "push_1ms_step": (prefill_1ms, decode_1ms, PrefillAddress("127.0.0.1", port_1ms)),
    }
    if spec.device != "cpu":  # the default stages scattered pushes; the same, never staged
        port_direct = _free_port()
        direct = replace(cfg, staging_bytes=0, side_channel_port=port_direct)
        pairs["push_direct"] = (
            Side("prefill", direct, spec, seed=1),
            Side("decode", replace(direct, engine_id="bench-decode", side_channel_port=0), spec),
            PrefillAddress("127.0.0.1", port_direct),
        )
    rows = []
    contiguous_write: dict[int, float] = {}  # raw WRITE ms of n contiguous blocks
    try:
        for pattern in ("contiguous", "fragmented"):
            for n in counts:
                ids, tokens = _block_ids(n, pattern), n * spec.block_size
                runs: dict[str, list[float]] = {}
                for r in range(repeats + 1):  # the first run warms connections up
                    pushed = {name: _push(*sides, ids, tokens) for name, sides in pairs.items()}
                    pushed["push_ahead"] = _push(*pairs["push"], ids, tokens, ahead=True)
                    out_p, blocked_s, out_d = pushed["push"]
                    cuda = spec.device != "cpu"
                    writes = (["WRITE_COLD"] if cuda else []) + ["WRITE", "WRITE_NOTIF"]
                    ops = [("READ", raw_d, raw_p_name, raw_p.layout)]
                    ops += [(op, raw_p, raw_d_name, raw_d.layout) for op in writes]
                    raw = {}
                    for op, side, far, far_layout in ops:
                        if cuda and op != "WRITE_COLD":
                            side.call("warm", None)  # as the push: see Memory.warm
                        raw[op] = side.call("op", (op, far, far_layout, ids, ids, tokens))
                        assert raw[op]["ok"], (op, raw[op])
                    pull, write, write_notif = raw["READ"], raw["WRITE"], raw["WRITE_NOTIF"]
                    marks = out_p.marks
                    sample = {
                        "push_ms": out_p.elapsed_s * 1e3,
                        "push_caller_blocked_ms": blocked_s * 1e3,
                        "push_1ms_step_ms": pushed["push_1ms_step"][0].elapsed_s * 1e3,
                        **{f"push_{k}_ms": v for k, v in push_parts_ms(marks).items()},
                        "push_ahead_ms": pushed["push_ahead"][0].elapsed_s * 1e3,
                        **{
                            f"push_ahead_{k}_ms": v
                            for k, v in push_parts_ms(pushed["push_ahead"][0].marks).items()
                        },
                        "raw_write_notif_ms": write_notif["total_ms"],
                        "pull_ms": pull["total_ms"],
                        "pull_caller_blocked_ms": pull["caller_blocked_ms"],
                        "raw_write_ms": write["total_ms"],
                    }
                    if spec.device != "cpu":  # the candidates of issue 12
                        # the WRITE with notification as the first GPU work in its process
                        # after the other process's READ, not warmed: what one GPU shared
                        # by two processes adds (Memory.warm)
                        sample["raw_write_cold_ms"] = raw["WRITE_COLD"]["total_ms"]
                        sample["push_direct_ms"] = pushed["push_direct"][0].elapsed_s * 1e3
                        # hand-over on prefill -> decode counts the data landed (and, staged,
                        # scattered): what a request waits for, on one host's clock
                        for name in ("push", "push_direct", "push_ahead"):
                            p_out, _, d_out = pushed[name]
                            landed_s = d_out.marks["notified"] - p_out.marks["handed"]
                            sample[f"{name}_landed_ms"] = landed_s * 1e3
                        if "gathered" in marks:  # staged: the push's gather, decode's scatter
                            sample["push_gather_ms"] = (marks["gathered"] - marks["handed"]) * 1e3
                            land = out_d.marks
                            sample["push_scatter_ms"] = (land["notified"] - land["landed"]) * 1e3
                        sample |= _candidates(raw_p, raw_d, raw_d_name, ids, tokens)
                    if r == 0:
                        continue
                    for name, value in sample.items():
                        runs.setdefault(name, []).append(value)
                num_bytes = n * block_bytes * spec.num_regions
                if spec.device != "cpu":
                    runs["d2d_copy_ms"] = [_d2d_copy_ms(num_bytes, repeats)]
                    if pattern == "contiguous":
                        contiguous_write[n] = statistics.median(runs["raw_write_ms"])
                    # Staged: gather + one contiguous WRITE of the same bytes + scatter.
                    runs["staged_estimate_ms"] = [
                        g + contiguous_write[n] + sc
                        for g, sc in zip(runs["gather_ms"], runs["scatter_ms"], strict=True)
                    ]
                row = {
                    "cross_layer": spec.cross_layer,
                    "block_bytes": block_bytes,
                    "num_regions": spec.num_regions,
                    "num_blocks": n,
                    "num_tokens": tokens,
                    "pattern": pattern,
                    "num_bytes": num_bytes,
                    "push_descs": out_p.num_descs,
                    "pull_descs": pull["descs"],
                    "repeats": repeats,
                } | {f"{k}_median": statistics.median(v) for k, v in runs.items()}
                row["push_gbps"] = num_bytes / row["push_ms_median"] / 1e6
                row["raw_write_gbps"] = num_bytes / row["raw_write_ms_median"] / 1e6
                if "d2d_copy_ms_median" in row:
                    row["d2d_gbps"] = num_bytes / row["d2d_copy_ms_median"] / 1e6
                rows.append(row)
                _print_row(row)
    finally:
        for p_side, d_side, _ in pairs.values():
            p_side.close()
            d_side.close()
        raw_p.close()
        raw_d.close()
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _push(
    prefill: Side, decode: Side, address: Any, ids: list, tokens: int, ahead: bool = False
) -> tuple:
    """One push, decode registered first, from warm CUDA contexts (Memory.warm):
    (prefill's outcome, its caller's held seconds, decode's outcome). `ahead`: prefill is
    told the blocks first (PrefillEndpoint.prepare, as the connector does while the prompt's
    last tokens are computed) and makes the WRITE ready before the push."""
    from kvpush.transfer.wire import TransferKey

    key = TransferKey(uuid.uuid4().hex)
    fd = decode.call("expect", key, address, ids, tokens)
    while prefill.call("gauges")["pending_match"] < 1:
        time.sleep(0.0005)
    if ahead:
        prefill.wait(prefill.call("prepare", key, ids, tokens))
    if prefill.spec.device != "cpu":
        decode.call("warm")
        prefill.call("warm")
    fp, blocked_s = prefill.call("timed", "push", key, ids, tokens)
    out_p, out_d = prefill.wait(fp), decode.wait(fd)
    assert out_p.ok and out_d.ok, (out_p, out_d)
    return out_p, blocked_s, out_d


def push_parts_ms(marks: dict[str, float]) -> dict[str, float]:
    """A push's own timeline on prefill's loop thread, ms: hand-over -> copy plan and
    descriptors built ("plan") -> WRITE posted ("post") -> WRITE complete ("complete")."""
    steps = {"plan": ("handed", "planned"), "post": ("planned", "posted")}
    steps["complete"] = ("posted", "written")
    return {k: (marks[b] - marks[a]) * 1e3 for k, (a, b) in steps.items()}


def _candidates(raw_p: RawSide, raw_d: RawSide, raw_d_name: str, ids: list, tokens: int) -> dict:
    """One sample of each issue-12 candidate for the same blocks as the push."""
    raw_p.call("warm", None)
    prepped = raw_p.call("op", ("WRITE_PREPPED", raw_d_name, raw_d.layout, ids, ids, tokens))
    gather = raw_p.call("op", ("GATHER", None, raw_d.layout, ids, ids, tokens))
    scatter = raw_d.call("op", ("SCATTER", None, raw_p.layout, ids, ids, tokens))
    assert prepped["ok"] and gather["ok"] and scatter["ok"], (prepped, gather, scatter)
    return {
        "raw_prepped_write_ms": prepped["total_ms"],
        "gather_ms": gather["kernel_ms"],
        "gather_wall_ms": gather["wall_ms"],
        "scatter_ms": scatter["kernel_ms"],
        "scatter_wall_ms": scatter["wall_ms"],
    }


HEADER = (
    f"{'block':>7} {'blocks':>6} {'pattern':>10} {'push ms':>8} {'ahead ms':>8} {'1ms-step':>8} "
    f"{'pull ms':>8} "
    f"{'raw ms':>8} "
    f"{'descs':>6} {'push blk ms':>11} {'pull blk ms':>11} {'GB/s':>6} {'d2d ms':>7}"
)


def _print_row(r: dict) -> None:
    d2d = r.get("d2d_copy_ms_median")
    print(
        f"{r['block_bytes'] // KIB:>6}K {r['num_blocks']:>6} {r['pattern']:>10} "
        f"{r['push_ms_median']:>8.2f} {r['push_ahead_ms_median']:>8.2f} "
        f"{r['push_1ms_step_ms_median']:>8.2f} "
        f"{r['pull_ms_median']:>8.2f} {r['raw_write_ms_median']:>8.2f} "
        f"{r['push_descs']:>6} {r['push_caller_blocked_ms_median']:>11.3f} "
        f"{r['pull_caller_blocked_ms_median']:>11.3f} {r['push_gbps']:>6.2f} "
        f"{'-' if d2d is None else f'{d2d:.3f}':>7}",
        flush=True,
    )
    if "staged_estimate_ms_median" in r:
        print(
            f"{'':>8}landed on decode {r['push_landed_ms_median']:.2f} ms; direct (staging "
            f"off) {r['push_direct_ms_median']:.2f} ms, landed "
            f"{r['push_direct_landed_ms_median']:.2f} ms; "
            f"candidates: prepped WRITE {r['raw_prepped_write_ms_median']:.2f} ms, "
            f"gather {r['gather_ms_median']:.3f} ms + scatter {r['scatter_ms_median']:.3f} ms "
            f"(kernels), staged {r['staged_estimate_ms_median']:.2f} ms",
            flush=True,
        )


UCX_TRANSPORT = re.compile(
    r"\b(cuda_ipc|cuda_copy|gdr_copy|rc_mlx5|rc_verbs|dc_mlx5|ud_mlx5|"
    r"tcp|sysv|posix|cma|xpmem|knem|self)\b"
)


def _transports(log_dir: str) -> dict:
    """What UCX printed (UCX_PROTO_INFO) in the benchmark's processes: the transports named
    on the lines that describe a protocol, and those lines."""
    lines = []
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            lines += [ln.rstrip() for ln in f if UCX_TRANSPORT.search(ln)]
    names = sorted({m for ln in lines for m in UCX_TRANSPORT.findall(ln)})
    unique = list(dict.fromkeys(lines))
    return {"transports": names, "lines": unique[:200]}


def main(quick: bool = False, out: Path | None = None, device: str = "cpu") -> int:
    repeats = 3 if quick else 5
    memory = "DRAM" if device == "cpu" else "VRAM"
    print(
        f"kvpush bench transfer ({'quick' if quick else 'full'}): {memory} over NIXL/UCX, "
        f"medians of {repeats} runs",
        flush=True,
    )
    log_dir = tempfile.mkdtemp(prefix="kvpush-bench-")
    if device != "cpu":
        _check_cuda()
        os.environ.setdefault("UCX_PROTO_INFO", "y")  # which transport carries the WRITE
        os.environ["KVPUSH_CHILD_LOG_DIR"] = log_dir  # the children's C-level output
    print(HEADER, flush=True)
    rows: list[dict] = []
    result: dict[str, Any] = {
        "benchmark": "transfer",
        "quick": quick,
        "memory": memory,
        "backend": "UCX",
        "host": _host(device),
        "created_unix_s": int(time.time()),
        "rows": rows,
    }

    def save() -> None:  # after each shape, so a run cut short keeps what it measured
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))

    if device == "cpu":
        result["shape"] = "one region, 16-token blocks of 4 KiB to 1 MiB"
        grid = QUICK_GRID if quick else FULL_GRID
        for block_bytes in grid["block_bytes"]:
            spec = LayoutSpec(
                block_size=TOKENS_PER_BLOCK,
                num_heads=1,
                head_bytes=block_bytes // TOKENS_PER_BLOCK,
                num_regions=1,
            )
            rows += _run_shape(spec, grid["num_blocks"], repeats)
            save()
    else:
        result["shape"] = (
            "Qwen3-32B, one TP-8 rank: 64 layers x K,V regions, 1 KV head of 128, bf16; "
            "layer-outer (each region its own tensor), then cross-layer (block-outer, one "
            "buffer, rows with cross_layer: true)"
        )
        tokens = CUDA_TOKENS["quick" if quick else "full"]
        spec = QWEN3_32B_TP8
        counts = [t // spec.block_size for t in tokens]
        rows += _run_shape(spec, counts, repeats)
        save()
        print("cross-layer (block-outer) layout of the same rank:", flush=True)
        rows += _run_shape(replace(spec, cross_layer=True), counts, repeats)
        result["ucx"] = _transports(log_dir)
        print(f"UCX transports seen: {', '.join(result['ucx']['transports']) or 'none printed'}")
    save()
    if out:
        print(f"wrote {out}")
    return 0


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def _check_cuda() -> None:
    try:
        import torch
    except ImportError as e:
        raise SystemExit("--device cuda needs PyTorch with CUDA") from e
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no CUDA device")


def _host(device: str) -> dict:
    host = {
        "machine": platform.machine(),
        "cpus": _cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    if device != "cpu":
        import torch

        host |= {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }
    try:
        from importlib.metadata import version

        host["nixl"] = version("nixl-cu13")
    except Exception:
        host["nixl"] = "unknown"
    return host
