"""Variants of kvpush/transfer/batchcopy.py's kernel on 131,072 scattered 4 KiB rows (512 MiB),
kernel time only (CUDA events; the row arrays are on the GPU beforehand), against a plain
device copy and torch.index_select. Each variant is checked byte-exact.

Run on a CUDA host: python benchmarks/scripts/batchcopy_variants.py OUT.json
"""

import json
import sys

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def copy_row(src_ptr, dst_ptr, len_ptr, row, CHUNK: tl.constexpr):
    """Row `row` of the plan, in CHUNK-element pieces of 8 bytes."""
    src = tl.load(src_ptr + row).to(tl.pointer_type(tl.int64))
    dst = tl.load(dst_ptr + row).to(tl.pointer_type(tl.int64))
    n = tl.load(len_ptr + row) // 8
    offs = tl.arange(0, CHUNK)
    for start in range(0, n, CHUNK):
        idx = start + offs
        m = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)


@triton.jit
def rows_loop(src_ptr, dst_ptr, len_ptr, CHUNK: tl.constexpr):
    # one row per program (the shape kvpush/transfer/batchcopy.py uses)
    copy_row(src_ptr, dst_ptr, len_ptr, tl.program_id(0), CHUNK)


@triton.jit
def rows_multi(src_ptr, dst_ptr, len_ptr, num_rows, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    # ROWS rows per program
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < num_rows:
            copy_row(src_ptr, dst_ptr, len_ptr, row, CHUNK)


@triton.jit
def rows_2d(src_ptr, dst_ptr, len_ptr, CHUNK: tl.constexpr):
    # grid (rows, chunks): one piece per program
    row = tl.program_id(0)
    piece = tl.program_id(1)
    src = tl.load(src_ptr + row).to(tl.pointer_type(tl.int64))
    dst = tl.load(dst_ptr + row).to(tl.pointer_type(tl.int64))
    n = tl.load(len_ptr + row) // 8
    idx = piece * CHUNK + tl.arange(0, CHUNK)
    m = idx < n
    tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)


def timeit(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return float(np.median(ts))


rows, rb = 131072, 4096
src = torch.randint(0, 127, (2 * rows * rb,), dtype=torch.uint8, device="cuda")
dst = torch.zeros(rows * rb, dtype=torch.uint8, device="cuda")
ids = np.arange(0, 2 * rows, 2)  # every other block: scattered
np.random.default_rng(0).shuffle(ids)
s = torch.tensor(src.data_ptr() + ids * rb, dtype=torch.int64, device="cuda")
d = torch.tensor(dst.data_ptr() + np.arange(rows) * rb, dtype=torch.int64, device="cuda")
n = torch.full((rows,), rb, dtype=torch.int64, device="cuda")
out = {"d2d_ms": timeit(lambda: dst.copy_(src[: rows * rb]))}
ref = src.view(2 * rows, rb)[torch.from_numpy(ids).cuda()].reshape(-1)
for chunk in (256, 512, 1024):
    for w in (2, 4, 8):
        out[f"loop_c{chunk}_w{w}"] = timeit(
            lambda chunk=chunk, w=w: rows_loop[(rows,)](s, d, n, CHUNK=chunk, num_warps=w)
        )
        assert torch.equal(dst, ref)
        dst.zero_()
for r in (4, 16):
    for w in (4, 8):
        out[f"multi_r{r}_c512_w{w}"] = timeit(
            lambda r=r, w=w: rows_multi[(rows // r,)](s, d, n, rows, ROWS=r, CHUNK=512, num_warps=w)
        )
        assert torch.equal(dst, ref)
        dst.zero_()
for chunk in (128, 256):
    out[f"2d_c{chunk}"] = timeit(
        lambda chunk=chunk: rows_2d[(rows, rb // 8 // chunk)](s, d, n, CHUNK=chunk, num_warps=4)
    )
    assert torch.equal(dst, ref)
    dst.zero_()
out["torch_index_select"] = timeit(
    lambda: torch.index_select(
        src.view(2 * rows, rb), 0, torch.from_numpy(ids).cuda(), out=dst.view(rows, rb)
    )
)
for k, v in sorted(out.items(), key=lambda kv: kv[1]):
    print(f"{k:>24} {v:8.3f} ms  {2 * rows * rb / v / 1e6:7.0f} GB/s (r+w)")
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
