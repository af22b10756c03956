"""One GPU kernel that copies many (src, dst, len) byte ranges: the gather and scatter steps
of a staged transfer, measured by `kvpush bench transfer --device cuda` (issue 12).

A scattered copy plan of 16k tokens is 131,072 rows of 4 KiB. Posted as NIXL descriptors
each row costs about 7 us; copied by one kernel launch (one program per row, 8-byte words
where every address and length allows) the rows move at device-memory speed.

CUDA only: Triton and PyTorch are imported when first used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_kernel: Any = None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(src_ptr, dst_ptr, len_ptr, WORD: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        if WORD == 8:
            ty = tl.pointer_type(tl.int64)
        elif WORD == 4:
            ty = tl.pointer_type(tl.int32)
        else:
            ty = tl.pointer_type(tl.int8)
        src = tl.load(src_ptr + row).to(ty)
        dst = tl.load(dst_ptr + row).to(ty)
        n = tl.load(len_ptr + row) // WORD
        offs = tl.arange(0, CHUNK)
        for start in range(0, n, CHUNK):
            idx = start + offs
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    return copy_rows


def word_size(src: np.ndarray, dst: np.ndarray, num_bytes: np.ndarray) -> int:
    """The widest word (8, 4 or 1 bytes) that every address and length is a multiple of."""
    every = 0
    for a in (src, dst, num_bytes):
        every |= int(np.bitwise_or.reduce(np.asarray(a, dtype=np.int64)))
    for word in (8, 4):
        if every % word == 0:
            return word
    return 1


def copy_rows(src: np.ndarray, dst: np.ndarray, num_bytes: np.ndarray, stream: Any = None) -> None:
    """Launch one kernel copying num_bytes[i] bytes from device address src[i] to dst[i] on
    `stream` (the current one by default). Returns at once; order and wait with the stream."""
    global _kernel
    import torch

    if len(src) == 0:
        return
    if _kernel is None:
        _kernel = _build()
    word = word_size(src, dst, num_bytes)
    rows = np.stack([np.asarray(a, dtype=np.int64) for a in (src, dst, num_bytes)])
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        args = torch.from_numpy(rows).to("cuda")  # one host-to-device copy for all rows
        _kernel[(len(src),)](args[0], args[1], args[2], WORD=word, CHUNK=1024)


def warm_up(stream: Any = None) -> None:
    """Compile the kernel for every word size now (Triton compiles on first launch, which
    takes about a second each), with 8-byte copies inside a scratch buffer."""
    import torch

    scratch = torch.zeros(64, dtype=torch.uint8, device="cuda")
    base = scratch.data_ptr()
    for word in (8, 4, 1):
        copy_rows(np.array([base]), np.array([base + 32]), np.array([word]), stream)
    (stream or torch.cuda.current_stream()).synchronize()
