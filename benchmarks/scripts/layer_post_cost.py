"""What one layer's WRITE costs the endpoint's thread, on DRAM or a GPU: made ready the way the
writer makes it (two descriptor lists, then initialize_xfer) against NIXL's prepared lists
(prep_xfer_dlist once, then make_prepped_xfer by row), and the post (transfer) after either.

One process, two NIXL agents over UCX, progress thread off; one layer = its K and V regions
of one Qwen3-32B TP-8 rank at 1,024 tokens (64 blocks of 4 KiB each), 64 layers, each WRITE
waited for before the next. Medians over 640 WRITEs after 3 warm-up rounds.

    python benchmarks/scripts/layer_post_cost.py OUT.json [cpu|cuda] [one|apart]
(cuda: both agents' buffers on GPU 0, VRAM; apart: each region its own allocation, not one
allocation per side)
"""

import json
import statistics
import sys
import threading
import time

import numpy as np

LAYERS, BLOCKS, BLOCK_BYTES = 64, 64, 4096
ROUNDS = 640


def main(out: str, device: str = "cpu", alloc: str = "one") -> None:
    from kvpush.transfer.agent import _nixl_api

    api = _nixl_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("a", cfg), nixl_agent("b", cfg)
    size = BLOCKS * BLOCK_BYTES
    # `apart`: every region its own allocation; else one allocation per side, sliced into
    # regions, as vLLM allocates a layer's KV cache in one
    count, each = (4 * LAYERS, size) if alloc == "apart" else (2, 2 * LAYERS * size)
    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
        keep = [torch.zeros(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
        bases = [t.data_ptr() for t in keep]
        mem = "VRAM"
    else:
        keep = [np.zeros(each, np.uint8) for _ in range(count)]
        bases = [x.ctypes.data for x in keep]
        mem = "DRAM"
    addrs = [base + i * size for base in bases for i in range(each // size)]
    src, dst = addrs[: 2 * LAYERS], addrs[2 * LAYERS :]
    for agent, bufs in ((a, src), (b, dst)):
        agent.register_memory([(x, size, 0, "") for x in bufs], mem)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())

    def descs(bufs: list, layer: int) -> np.ndarray:
        rows = [[bufs[r], size, 0] for r in (2 * layer, 2 * layer + 1)]
        return np.array(rows, dtype=np.uint64)

    def complete(handle) -> None:
        while (state := a.check_xfer_state(handle)) != "DONE":
            assert state != "ERR"
            b.get_new_notifs()
        a.release_xfer_handle(handle)

    def initialized(layer: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        local = a.get_xfer_descs(descs(src, layer), mem)
        far = a.get_xfer_descs(descs(dst, layer), mem)
        handle = a.initialize_xfer("WRITE", local, far, "b", b"")
        t1 = time.perf_counter()
        a.transfer(handle)
        t2 = time.perf_counter()
        complete(handle)
        return t1 - t0, t2 - t1

    every = np.concatenate([descs(src, i) for i in range(LAYERS)])
    local_list = a.prep_xfer_dlist("NIXL_INIT_AGENT", every, mem)
    far_list = a.prep_xfer_dlist("b", np.concatenate([descs(dst, i) for i in range(LAYERS)]), mem)

    def prepped(layer: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        rows = np.array([2 * layer, 2 * layer + 1], dtype=np.int32)
        handle = a.make_prepped_xfer("WRITE", local_list, rows, far_list, rows)
        t1 = time.perf_counter()
        a.transfer(handle)
        t2 = time.perf_counter()
        complete(handle)
        return t1 - t0, t2 - t1

    def gil_held(way) -> dict:
        """Whether NIXL holds the GIL while it makes ready and posts: another Python thread
        records the gaps between its loop's turns while this one writes 64 layers; with
        Python's switch interval at 0.1 ms, gaps over 0.5 ms are time in a C call that kept
        the GIL. vLLM's forward runs in such another thread of prefill's worker process."""
        gaps: list[float] = []
        stop = threading.Event()

        def spin() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                now = time.perf_counter()
                if now - last > 5e-4:
                    gaps.append(now - last)
                last = now

        before = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        held = [way(layer) for layer in range(LAYERS)]
        elapsed = time.perf_counter() - t0
        stop.set()
        spinner.join()
        sys.setswitchinterval(before)
        return {
            "writes": LAYERS,
            "elapsed_ms": elapsed * 1e3,
            "made_ready_and_post_ms": sum(h[0] + h[1] for h in held) * 1e3,
            "spinner_gaps_over_0.5ms": len(gaps),
            "spinner_gap_ms_total": sum(gaps) * 1e3,
        }

    result = {
        "device": device,
        "allocations": alloc,
        "layers": LAYERS,
        "bytes_per_write": 2 * size,
        "writes": ROUNDS,
    }
    for name, way in (("initialize_xfer", initialized), ("make_prepped_xfer", prepped)):
        for _ in range(3):
            for layer in range(LAYERS):
                way(layer)
        times = [way(i % LAYERS) for i in range(ROUNDS)]
        result[name] = {
            "made_ready_ms": statistics.median(t[0] for t in times) * 1e3,
            "post_ms": statistics.median(t[1] for t in times) * 1e3,
            "gil": gil_held(way),
        }
        print(name, result[name])
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
