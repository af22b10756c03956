"""One GPU kernel that copies many (src, dst, len) byte ranges: the gather and scatter steps
of a staged transfer, measured by `kvpush bench transfer --device cuda` (issue 12).

A scattered copy plan of 16k tokens is 131,072 rows of 4 KiB. Posted as NIXL descriptors
each row costs about 7 us; copied by one kernel launch (one program per row and region,
8-byte words where every address and length allows) the rows move at device-memory speed.
The rows come relative to a region's base, with the bases apart (layout.RegionPlan): the
host builds and uploads one region's rows (1,024 for those 16k tokens), not every region's.

CUDA only: Triton and PyTorch are imported when first used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_kernel: Any = None
# Words each program moves per step, and warps per program. Each (chunk, num_warps) is a
# kernel of its own for Triton, compiled on first use; warm_up() compiles the defaults.
CHUNK = 1024
NUM_WARPS = 4
# A row longer than this is cut into pieces, one program each: one program copies its row
# alone, so a single long row (a run of many blocks) would otherwise serialise the copy
# (measured: one 512 MiB row took 36 ms on the H200, against 0.3 ms for 131,072 rows).
MAX_ROW_BYTES = 64 << 10


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(
        src_ptr,
        dst_ptr,
        len_ptr,
        src_base_ptr,
        dst_base_ptr,
        WORD: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0)
        region = tl.program_id(1)
        if WORD == 8:
            ty = tl.pointer_type(tl.int64)
        elif WORD == 4:
            ty = tl.pointer_type(tl.int32)
        else:
            ty = tl.pointer_type(tl.int8)
        src = (tl.load(src_base_ptr + region) + tl.load(src_ptr + row)).to(ty)
        dst = (tl.load(dst_base_ptr + region) + tl.load(dst_ptr + row)).to(ty)
        n = tl.load(len_ptr + row) // WORD
        offs = tl.arange(0, CHUNK)
        for start in range(0, n, CHUNK):
            idx = start + offs
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    return copy_rows


def word_size(*arrays: Any) -> int:
    """The widest word (8, 4 or 1 bytes) that every address and length is a multiple of."""
    every = 0
    for a in arrays:
        every |= int(np.bitwise_or.reduce(np.asarray(a, dtype=np.int64)))
    for word in (8, 4):
        if every % word == 0:
            return word
    return 1


def copy_rows(
    src: np.ndarray,
    dst: np.ndarray,
    num_bytes: np.ndarray,
    stream: Any = None,
    src_bases: Any = (0,),
    dst_bases: Any = (0,),
    chunk: int = CHUNK,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch one kernel copying num_bytes[i] bytes from device address src_bases[r] + src[i]
    to dst_bases[r] + dst[i], for every row i and every region r (the rows of a plan that
    repeats in each region: layout.RegionPlan), on `stream` (the current one by default).
    Returns at once; order and wait with the stream."""
    global _kernel
    import torch

    if len(src) == 0 or len(src_bases) == 0:
        return
    if _kernel is None:
        _kernel = _build()
    packed, word, num_rows = pack(src, dst, num_bytes, src_bases, dst_bases)
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        args = torch.from_numpy(packed).to("cuda")  # one host-to-device copy for everything
        launch(_kernel, args, num_rows, word, chunk, num_warps)


def pack(
    src: Any,
    dst: Any,
    num_bytes: Any,
    src_bases: Any,
    dst_bases: Any,
    max_row_bytes: int = MAX_ROW_BYTES,
) -> tuple[np.ndarray, int, int]:
    """The kernel's arguments as one int64 array (rows' src, dst, lengths, then the regions'
    source and destination bases), the word size they allow, and the number of rows after
    rows longer than `max_row_bytes` were cut into pieces."""
    if len(src_bases) != len(dst_bases):
        raise ValueError(f"{len(src_bases)} source regions, {len(dst_bases)} destination regions")
    if max_row_bytes < 8 or max_row_bytes % 8:
        raise ValueError(f"max_row_bytes must be a positive multiple of 8, got {max_row_bytes}")
    src_, dst_, len_ = (np.asarray(a, dtype=np.int64) for a in (src, dst, num_bytes))
    rows = split_rows(src_, dst_, len_, max_row_bytes)
    bases = [np.asarray(a, dtype=np.int64) for a in (src_bases, dst_bases)]
    arrays = [*rows, *bases]
    return np.concatenate(arrays), word_size(*arrays), len(rows[0])


def split_rows(
    src: np.ndarray, dst: np.ndarray, num_bytes: np.ndarray, max_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same copies, with every row longer than `max_bytes` cut into pieces of at most
    `max_bytes` (a multiple of 8, so the pieces keep the rows' word alignment)."""
    pieces = np.maximum(1, -(-num_bytes // max_bytes))
    if (pieces == 1).all():
        return src, dst, num_bytes
    row = np.repeat(np.arange(len(num_bytes)), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)  # each row's first piece
    offset = (np.arange(len(row)) - first) * max_bytes
    return src[row] + offset, dst[row] + offset, np.minimum(num_bytes[row] - offset, max_bytes)


def launch(kernel: Any, args: Any, num_rows: int, word: int, chunk: int, num_warps: int) -> None:
    """Run `kernel` over a packed argument tensor (pack()) already where the kernel runs."""
    n = num_rows
    rows, bases = args[: 3 * n].view(3, n), args[3 * n :].view(2, -1)
    grid = (n, bases.shape[1])
    kernel[grid](
        rows[0], rows[1], rows[2], bases[0], bases[1], WORD=word, CHUNK=chunk, num_warps=num_warps
    )


def warm_up(stream: Any = None) -> None:
    """Compile the kernel for every word size now (Triton compiles on first launch, which
    takes about a second each), with 8-byte copies inside a scratch buffer."""
    import torch

    scratch = torch.zeros(64, dtype=torch.uint8, device="cuda")
    base = scratch.data_ptr()
    for word in (8, 4, 1):
        copy_rows(np.array([base]), np.array([base + 32]), np.array([word]), stream)
    (stream or torch.cuda.current_stream()).synchronize()
