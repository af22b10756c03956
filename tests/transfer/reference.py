"""An independent, slow, obviously-right model of where each (token, head) lives."""

from __future__ import annotations

import numpy as np

from kvpush.transfer.harness import LayoutSpec


def offset(spec: LayoutSpec, block_ids: list[int], token: int, head: int) -> int:
    block, pos = block_ids[token // spec.block_size], token % spec.block_size
    base = block * spec.block_size * spec.num_heads * spec.head_bytes
    local = head - spec.first_head
    if spec.head_major:
        return base + (local * spec.block_size + pos) * spec.head_bytes
    return base + (pos * spec.num_heads + local) * spec.head_bytes


def expected_after_push(
    src: list[np.ndarray],
    dst: list[np.ndarray],
    src_spec: LayoutSpec,
    dst_spec: LayoutSpec,
    src_ids: list[int],
    dst_ids: list[int],
    start: int,
    end: int,
    heads: range,
) -> list[np.ndarray]:
    out = [a.copy() for a in dst]
    hb = src_spec.head_bytes
    for r in range(len(src)):
        for t in range(start, end):
            for h in heads:
                s = offset(src_spec, src_ids, t, h)
                d = offset(dst_spec, dst_ids, t, h)
                out[r][d : d + hb] = src[r][s : s + hb]
    return out
