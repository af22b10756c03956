"""Staged transfers: a scattered push as gather, one contiguous WRITE, scatter (issue 12).

Posting one NIXL descriptor per scattered block run costs about 7 us each (131,072 of them
for 16k tokens of one Qwen3-32B TP rank on the H200). Staged, the same push is:

1. prefill copies the plan's rows into a slot of its own staging area (one kernel launch,
   batchcopy.py, at device-memory speed) and waits for that copy;
2. one WRITE of the packed slot, a single descriptor, into the slot decode reserved for the
   registration, carrying the usual notification (with the token range it staged);
3. decode copies its slot out into the request's blocks, waits for that copy, and only then
   counts the WRITE as landed: vLLM reads the blocks only after the scatter is complete.

Both slots have the same geometry (`slot_layout`): a KVLayout of its own whose blocks are
contiguous, region after region, holding only the heads the registration names, in
decode's block size. The gather and the scatter are ordinary copy plans into and out of it.

A staging area is one buffer per endpoint, registered with NIXL once, carved into slots
first-fit. It is bounded: a push that finds no slot free (on either side) goes direct, as
without staging. Decode holds a slot from the registration until no prefill rank can write
into it any more (the same rule as its blocks); prefill only from the gather until its WRITE
completes. On DRAM the copies are plain memmoves (tests; staging is off there by default).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvpush.transfer.layout import KVLayout, RegionPlan, RegionSpec

SLOT_ALIGN = 256  # bytes: every slot starts on this, so the kernel can copy in 8-byte words
DEFAULT_VRAM_STAGING_BYTES = 1 << 30  # per endpoint, where the KV cache is in VRAM


def resolve_staging_bytes(setting: int | None, mem_type: str) -> int:
    """`None` (the default): 1 GiB where the KV is in VRAM, none on DRAM. 0 turns it off."""
    if setting is None:
        return DEFAULT_VRAM_STAGING_BYTES if mem_type == "VRAM" else 0
    return setting


def slot_layout(
    base_addr: int, like: KVLayout, heads: range, start: int, num_tokens: int
) -> tuple[KVLayout, list[int]]:
    """The staging slot for tokens [start, num_tokens) (rounded out to whole blocks of
    `like.block_size`, so a padded tail fits) of `heads`: its layout, and block ids that cover
    tokens from position 0 as copy plans expect (ids before the first staged block are never
    touched)."""
    bs = like.block_size
    first = start // bs
    num_blocks = max(1, -(-num_tokens // bs) - first)
    block_bytes = bs * len(heads) * like.num_parts * like.head_bytes
    region_bytes = num_blocks * block_bytes
    regions = tuple(
        RegionSpec(base_addr + r * region_bytes, block_bytes) for r in range(len(like.regions))
    )
    layout = KVLayout(
        regions,
        num_blocks,
        bs,
        len(heads),
        like.head_bytes,
        like.head_major,
        heads.start,
        like.heads_total,
        num_parts=like.num_parts,
        dim_major_parts=like.dim_major_parts,
        elem_bytes=like.elem_bytes,
    )
    ids = [0] * first + list(range(num_blocks))
    return layout, ids


def slot_bytes(layout: KVLayout) -> int:
    """How many bytes a slot layout from `slot_layout` spans."""
    return len(layout.regions) * layout.num_blocks * layout.block_bytes


def slot_size(like: KVLayout, heads: range, start: int, num_tokens: int) -> int:
    """How many bytes `slot_layout` of these arguments spans, wherever it is placed."""
    return slot_bytes(slot_layout(0, like, heads, start, num_tokens)[0])


class StagingArea:
    """One buffer (VRAM on `dev_id`, or DRAM), carved into slots first-fit. The endpoint's
    loop thread alone uses it; the endpoint registers it with NIXL."""

    def __init__(self, num_bytes: int, mem_type: str, dev_id: int = 0) -> None:
        if num_bytes < SLOT_ALIGN:
            raise ValueError(f"a staging area needs at least {SLOT_ALIGN} bytes, got {num_bytes}")
        self.num_bytes, self.mem_type, self.dev_id = num_bytes, mem_type, dev_id
        if mem_type == "VRAM":
            import torch

            self._buffer: Any = torch.empty(num_bytes, dtype=torch.uint8, device=f"cuda:{dev_id}")
            self.base_addr = self._buffer.data_ptr()
        else:
            self._buffer = np.empty(num_bytes, dtype=np.uint8)
            self.base_addr = self._buffer.ctypes.data
        self._free: list[tuple[int, int]] = [(self.base_addr, num_bytes)]  # (addr, size), sorted
        self._held: dict[int, int] = {}

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    def reserve(self, num_bytes: int) -> int | None:
        """The address of a free slot of at least `num_bytes`, or None when none is free."""
        size = -(-num_bytes // SLOT_ALIGN) * SLOT_ALIGN
        for i, (addr, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (addr + size, free - size)
                self._held[addr] = size
                return addr
        return None

    def release(self, addr: int) -> None:
        size = self._held.pop(addr)
        self._free.append((addr, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for a, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((a, n))
        self._free = merged


class Copier:
    """Runs a copy plan inside one process's memory and returns once it is complete: one
    batched-copy kernel on a stream of its own, waited for with a blocking event (the
    waiting thread sleeps), on VRAM; memmove per row on DRAM."""

    def __init__(self, mem_type: str) -> None:
        self._stream: Any = None
        if mem_type == "VRAM":
            import torch

            from kvpush.transfer import batchcopy

            self._stream = torch.cuda.Stream()
            batchcopy.warm_up(self._stream)  # compile now, not on the first push

    def run(self, plan: RegionPlan) -> None:
        if plan.rows.num_descs == 0:
            return
        if self._stream is None:
            flat = plan.absolute()
            src, dst = flat.src_addrs.tolist(), flat.dst_addrs.tolist()
            for s, d, n in zip(src, dst, flat.num_bytes.tolist(), strict=True):
                ctypes.memmove(d, s, n)
            return
        import torch

        from kvpush.transfer.batchcopy import copy_rows

        rows = plan.rows
        copy_rows(
            rows.src_addrs,
            rows.dst_addrs,
            rows.num_bytes,
            self._stream,
            plan.src_bases,
            plan.dst_bases,
        )
        done = torch.cuda.Event(blocking=True)
        done.record(self._stream)
        done.synchronize()
