"""An independent, slow, obviously-right model of where each (token, head) lives."""

from __future__ import annotations

import numpy as np

from kvpush.bench.harness import LayoutSpec


def offsets(spec: LayoutSpec, block_ids: list[int], token: int, head: int, part: int = 0):
    """Byte offsets, in order, of one token's vector of one head (and part)."""
    block, pos = block_ids[token // spec.block_size], token % spec.block_size
    base = block * spec.block_bytes
    local = head - spec.first_head
    hb, bs = spec.head_bytes, spec.block_size
    if not spec.head_major:
        start = base + (pos * spec.num_heads + local) * hb
        return list(range(start, start + hb))
    start = base + (local * spec.num_parts + part) * bs * hb
    if part in spec.dim_major_parts:  # element e of the vector sits at [e][pos]
        eb = spec.elem_bytes
        return [start + (e * bs + pos) * eb + b for e in range(hb // eb) for b in range(eb)]
    return list(range(start + pos * hb, start + (pos + 1) * hb))


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
    for r in range(len(src)):
        for t in range(start, end):
            for h in heads:
                for part in range(src_spec.num_parts):
                    s = offsets(src_spec, src_ids, t, h, part)
                    d = offsets(dst_spec, dst_ids, t, h, part)
                    out[r][d] = src[r][s]
    return out


def padded_end(src_spec: LayoutSpec, dst_spec: LayoutSpec, end: int) -> int:
    """The writer copies a partial last block whole when both sides' block sizes match."""
    if src_spec.block_size != dst_spec.block_size:
        return end
    return -(-end // src_spec.block_size) * src_spec.block_size
