"""How one rank's KV memory is laid out, and the copy plan between two layouts.

A rank holds `num_heads` KV heads (global heads `first_head ..`) in one or more registered
regions (one per layer, or one each for K and V). Every region holds `num_blocks` blocks,
`block_stride_bytes` apart; inside a block the bytes are either head-major
([head][part][token][head_bytes]) or token-major ([token][head][head_bytes]). `num_parts`
is 2 where K and V share a block head by head, else 1. A part listed in `dim_major_parts`
stores its elements dimension by dimension ([dim][token]): vLLM's CPU backend keeps K that
way and V token by token, so its block is [head][K: dim x token][V: token x dim].

`plan_copies` turns "tokens [start, end) of these prefill blocks go to these decode blocks"
into (src, dst, len) byte ranges, merged wherever both sides are contiguous.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from dataclasses import dataclass

import msgspec
import numpy as np


class RegionSpec(msgspec.Struct, frozen=True):
    base_addr: int
    block_stride_bytes: int


class KVLayout(msgspec.Struct, frozen=True, cache_hash=True):
    regions: tuple[RegionSpec, ...]
    num_blocks: int
    block_size: int  # tokens per block
    num_heads: int  # KV heads held by this rank
    head_bytes: int  # one token of one head: head_dim * dtype size
    head_major: bool
    first_head: int = 0  # global index of this rank's first KV head
    total_heads: int = 0  # KV heads of the whole model (0: same as num_heads)
    mem_type: str = "DRAM"  # "DRAM" or "VRAM"
    dev_id: int = 0
    num_parts: int = 1  # head-major only: K and V side by side inside each head
    dim_major_parts: tuple[int, ...] = ()  # parts stored [dim][token]
    elem_bytes: int = 1  # one element of a head vector (needed for dim-major parts)

    def __post_init__(self) -> None:
        if not self.regions:
            raise ValueError("a KV layout needs at least one region")
        for name in ("num_blocks", "block_size", "num_heads", "head_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_parts < 1 or (self.num_parts > 1 and not self.head_major):
            raise ValueError(f"num_parts {self.num_parts} needs a head-major layout")
        if any(not 0 <= p < self.num_parts for p in self.dim_major_parts):
            raise ValueError(f"dim_major_parts {self.dim_major_parts} outside {self.num_parts}")
        if self.head_bytes % self.elem_bytes:
            raise ValueError(f"head_bytes {self.head_bytes} not a multiple of {self.elem_bytes}")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be DRAM or VRAM, got {self.mem_type!r}")
        for r in self.regions:
            if r.block_stride_bytes < self.block_bytes:
                raise ValueError(
                    f"block_stride_bytes {r.block_stride_bytes} < block bytes {self.block_bytes}"
                )
        if self.first_head + self.num_heads > self.heads_total:
            raise ValueError(
                f"heads {self.first_head}..{self.first_head + self.num_heads} exceed "
                f"total_heads {self.heads_total}"
            )

    @property
    def heads_total(self) -> int:
        return self.total_heads or self.num_heads

    @property
    def token_bytes(self) -> int:
        return self.num_heads * self.num_parts * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def one_stride(self) -> bool:
        """Whether every region has the same block stride (vLLM's layers do)."""
        return _geometry(self).one_stride

    @property
    def tiles_blocks(self) -> bool:
        """Whether block b of every region, in order, forms one byte range (region r at
        base_0 + r * block_bytes, every stride regions * block_bytes): vLLM's block-outer
        ("cross-layer") cache layouts, BLHNC and BLNHC. A run of whole blocks is then one
        descriptor for all regions, not one per region."""
        return _geometry(self).tiles_blocks

    @property
    def region_num_bytes(self) -> int:
        return (self.num_blocks - 1) * self.regions[0].block_stride_bytes + self.block_bytes

    def shape_key(self) -> tuple:
        """What must agree between prefill and decode for data to be copyable at all."""
        return (
            len(self.regions),
            self.head_bytes,
            self.heads_total,
            self.head_major,
            self.num_parts,
            self.dim_major_parts,
            self.elem_bytes if self.dim_major_parts else 0,
        )


@dataclass(frozen=True)
class _Geometry:
    """What a push's plan reads of every region, worked out once per layout: a layout
    lives as long as its engine (or its peer's handshake), and going over 128 regions in
    Python for each push cost more than the plan's own arithmetic."""

    bases: np.ndarray  # int64 per region, read-only
    strides: np.ndarray
    one_stride: bool
    tiles_blocks: bool


@functools.lru_cache(maxsize=256)
def _geometry(layout: KVLayout) -> _Geometry:
    bases = np.array([r.base_addr for r in layout.regions], dtype=np.int64)
    strides = np.array([r.block_stride_bytes for r in layout.regions], dtype=np.int64)
    bases.flags.writeable = strides.flags.writeable = False
    tiled = len(bases) * layout.block_bytes
    return _Geometry(
        bases,
        strides,
        bool((strides == strides[0]).all()),
        bool((strides == tiled).all())
        and bool((bases == bases[0] + np.arange(len(bases)) * layout.block_bytes).all()),
    )


@dataclass(frozen=True)
class CopyPlan:
    """Byte ranges to WRITE: row i copies src[i] -> dst[i], num_bytes[i] long."""

    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    num_bytes: np.ndarray

    @property
    def num_descs(self) -> int:
        return len(self.num_bytes)

    @property
    def total_bytes(self) -> int:
        return int(self.num_bytes.sum())

    def select(self, rows: np.ndarray) -> CopyPlan:
        """The rows a boolean mask keeps (a push's regions written layer by layer)."""
        return CopyPlan(self.src_addrs[rows], self.dst_addrs[rows], self.num_bytes[rows])

    def descs(self, dev_src: int, dev_dst: int) -> tuple[np.ndarray, np.ndarray]:
        """Nx3 (addr, len, device) arrays, the form NIXL takes."""
        n = self.num_descs
        src = np.stack([self.src_addrs, self.num_bytes, np.full(n, dev_src)], axis=1)
        dst = np.stack([self.dst_addrs, self.num_bytes, np.full(n, dev_dst)], axis=1)
        return src.astype(np.uint64), dst.astype(np.uint64)


@dataclass(frozen=True)
class RegionPlan:
    """A copy plan that repeats in every region: `rows` are offsets from a region's base,
    and row i copies src_bases[r] + rows.src_addrs[i] -> dst_bases[r] + rows.dst_addrs[i]
    for every region r. Where regions differ in block stride, one pseudo-region at base 0
    carries the absolute plan."""

    rows: CopyPlan
    src_bases: np.ndarray
    dst_bases: np.ndarray

    @property
    def total_bytes(self) -> int:
        return self.rows.total_bytes * len(self.src_bases)

    def absolute(self) -> CopyPlan:
        """Every row of every region, with absolute addresses."""
        r = self.rows
        n = len(self.src_bases)
        return CopyPlan(
            (self.src_bases[:, None] + r.src_addrs[None, :]).reshape(-1),
            (self.dst_bases[:, None] + r.dst_addrs[None, :]).reshape(-1),
            np.tile(r.num_bytes, n),
        )


def plan_regions(
    src: KVLayout,
    dst: KVLayout,
    src_block_ids: list[int],
    dst_block_ids: list[int],
    start_token: int,
    end_token: int,
    heads: range | None = None,
) -> RegionPlan:
    """plan_copies, factored by region: the rows of one region, built once, and every
    region's base. Exact where every region of a side has one block stride (vLLM's layers
    do), since the rows then differ between regions only by the base."""
    if not (src.one_stride and dst.one_stride):
        plan = plan_copies(src, dst, src_block_ids, dst_block_ids, start_token, end_token, heads)
        zero = np.zeros(1, dtype=np.int64)
        return RegionPlan(plan, zero, zero)

    def one_region(lay: KVLayout) -> KVLayout:
        return msgspec.structs.replace(
            lay, regions=(RegionSpec(0, lay.regions[0].block_stride_bytes),)
        )

    if len(src.regions) != len(dst.regions):
        raise ValueError(f"layouts cannot be copied: {src.shape_key()} vs {dst.shape_key()}")
    rows = plan_copies(
        one_region(src),
        one_region(dst),
        src_block_ids,
        dst_block_ids,
        start_token,
        end_token,
        heads,
    )
    return RegionPlan(rows, _geometry(src).bases, _geometry(dst).bases)


def head_owner(head: int, tp_size: int, total_heads: int) -> int:
    """The one rank of a TP group that writes `head` (the first holder when heads replicate)."""
    if tp_size <= total_heads:
        return head // (total_heads // tp_size)
    return head * (tp_size // total_heads)


def rank_heads(rank: int, tp_size: int, total_heads: int) -> range:
    """Global KV heads held by `rank` of a TP group (replicated when tp_size > heads)."""
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} KV heads do not split over TP size {tp_size}")
        per = total_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if tp_size % total_heads:
        raise ValueError(f"TP size {tp_size} is not a multiple of {total_heads} KV heads")
    head = rank * total_heads // tp_size
    return range(head, head + 1)


def writer_heads(decode_heads: range, prefill_tp: int, total_heads: int) -> dict[int, range]:
    """For one decode rank: which prefill rank writes which of its heads."""
    out: dict[int, list[int]] = {}
    for h in decode_heads:
        out.setdefault(head_owner(h, prefill_tp, total_heads), []).append(h)
    return {rank: range(hs[0], hs[-1] + 1) for rank, hs in out.items()}


def padded_end(src: KVLayout, dst: KVLayout, end_token: int) -> int:
    """Where a push with `pad_tail` stops: a partial last block is copied whole when both
    sides' block sizes are equal (see plan_copies)."""
    bs = src.block_size
    if bs != dst.block_size:
        return end_token
    return -(-end_token // bs) * bs


def plan_copies(
    src: KVLayout,
    dst: KVLayout,
    src_block_ids: list[int],
    dst_block_ids: list[int],
    start_token: int,
    end_token: int,
    heads: range | None = None,
    pad_tail: bool = False,
) -> CopyPlan:
    """Plan the WRITE of tokens [start_token, end_token) of `heads` from src to dst blocks.

    Block id lists cover tokens from position 0 in each side's own block size. Rows are
    emitted region by region, token piece by piece, head by head, part by part, then merged
    where both the source and the destination continue exactly where the previous row ended.
    With `pad_tail` and equal block sizes, a partial last block is copied whole: its unused
    slots belong to the same request on decode, which overwrites them before reading them,
    and a whole block merges into far fewer descriptors.
    """
    if src.shape_key() != dst.shape_key():
        raise ValueError(f"layouts cannot be copied: {src.shape_key()} vs {dst.shape_key()}")
    heads = heads if heads is not None else range(dst.first_head, dst.first_head + dst.num_heads)
    for side, lay in (("prefill", src), ("decode", dst)):
        if heads.start < lay.first_head or heads.stop > lay.first_head + lay.num_heads:
            raise ValueError(f"heads {heads} are not all held by the {side} rank")
    if not 0 <= start_token <= end_token:
        raise ValueError(f"bad token range [{start_token}, {end_token})")
    src_ids = np.asarray(src_block_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64)
    for side, lay, ids in (("prefill", src, src_ids), ("decode", dst, dst_ids)):
        need = -(-end_token // lay.block_size)
        if len(ids) < need:
            raise ValueError(f"{side} has {len(ids)} blocks, {end_token} tokens need {need}")
        if need and (ids[:need].min() < 0 or ids[:need].max() >= lay.num_blocks):
            raise ValueError(f"{side} block id out of range 0..{lay.num_blocks - 1}")
    empty = np.zeros(0, dtype=np.int64)
    if start_token == end_token:
        return CopyPlan(empty, empty, empty)
    if pad_tail:
        end_token = padded_end(src, dst, end_token)

    num_regions = len(src.regions)
    stride_s, stride_d = _geometry(src).strides, _geometry(dst).strides
    if whole_blocks(src, dst, heads, start_token, end_token):
        # Fast path (equal layouts, every head, whole blocks; the usual push): one row per
        # block, merged into runs before the regions multiply them; where both sides tile
        # each block across the regions, one row per run covers every region.
        b0, b1 = start_token // src.block_size, end_token // src.block_size
        ids_s, ids_d = src_ids[b0:b1], dst_ids[b0:b1]
        if src.tiles_blocks and dst.tiles_blocks:
            base_s, base_d = src.regions[0].base_addr, dst.regions[0].base_addr
            s, d = base_s + ids_s * stride_s[0], base_d + ids_d * stride_d[0]
            return CopyPlan(*_merge_runs(s, d, np.full(len(s), stride_s[0], dtype=np.int64)))
        length = np.full(len(ids_s), src.block_bytes, dtype=np.int64)
        rows = _merge_runs(ids_s * stride_s[0], ids_d * stride_d[0], length)
        return _every_region(src, dst, *rows)

    # Token pieces that sit inside one source block and one destination block.
    cuts = [np.array([start_token, end_token], dtype=np.int64)]
    for bs in (src.block_size, dst.block_size):
        cuts.append(np.arange(-(-start_token // bs) * bs, end_token, bs, dtype=np.int64))
    bounds = np.unique(np.concatenate(cuts))
    tok0, tok1 = bounds[:-1], bounds[1:]
    src_blk = src_ids[tok0 // src.block_size]
    dst_blk = dst_ids[tok0 // dst.block_size]
    src_off, dst_off, ntok = tok0 % src.block_size, tok0 % dst.block_size, tok1 - tok0

    # Rows inside a block, the same for every region: byte offsets from the start of the
    # row's source and destination blocks, and lengths; shape (rows, columns).
    hb = src.head_bytes
    if src.head_major:
        # Per piece: for each (head, part), one column, or one per dimension when the part is
        # stored [dim][token].
        row_piece = np.arange(len(ntok))
        cols_s, cols_d, cols_n = [], [], []
        for h in heads:
            for part in range(src.num_parts):
                s0 = ((h - src.first_head) * src.num_parts + part) * src.block_size * hb
                d0 = ((h - dst.first_head) * dst.num_parts + part) * dst.block_size * hb
                if part in src.dim_major_parts:
                    eb = src.elem_bytes
                    dims = np.arange(hb // eb, dtype=np.int64)[None, :]
                    cols_s.append(s0 + (dims * src.block_size + src_off[:, None]) * eb)
                    cols_d.append(d0 + (dims * dst.block_size + dst_off[:, None]) * eb)
                    cols_n.append(np.broadcast_to((ntok * eb)[:, None], cols_s[-1].shape))
                else:
                    cols_s.append((s0 + src_off * hb)[:, None])
                    cols_d.append((d0 + dst_off * hb)[:, None])
                    cols_n.append((ntok * hb)[:, None])
        off_s, off_d, nn = (np.concatenate(c, axis=1) for c in (cols_s, cols_d, cols_n))
    else:
        # One row per (token, piece): [token][head] inside each block; a row covers `heads`.
        tok = np.concatenate([np.arange(k) for k in ntok]) if len(ntok) else empty
        row_piece = np.repeat(np.arange(len(ntok)), ntok)
        head_s = (heads.start - src.first_head) * hb
        head_d = (heads.start - dst.first_head) * hb
        off_s = ((src_off[row_piece] + tok) * src.token_bytes + head_s)[:, None]
        off_d = ((dst_off[row_piece] + tok) * dst.token_bytes + head_d)[:, None]
        nn = np.full(off_s.shape, len(heads) * hb, dtype=np.int64)

    # Every region at once: (regions, rows, columns), flattened region by region. Regions
    # differ only in their base address, so where every region has the same block stride and
    # a row has one column, consecutive rows are merged once, before the regions multiply them.
    blk_s, blk_d = src_blk[row_piece], dst_blk[row_piece]
    if nn.shape[1] == 1 and src.one_stride and dst.one_stride:
        rel_s = blk_s * stride_s[0] + off_s[:, 0]
        rel_d = blk_d * stride_d[0] + off_d[:, 0]
        return _every_region(src, dst, *_merge_runs(rel_s, rel_d, nn[:, 0]))
    rel_s, rel_d = off_s, off_d

    def addresses(layout: KVLayout, stride: np.ndarray, blocks: np.ndarray, rel: np.ndarray):
        start = _geometry(layout).bases[:, None] + stride[:, None] * blocks[None, :]
        return (start[:, :, None] + rel[None, :, :]).reshape(-1)

    s = addresses(src, stride_s, blk_s, rel_s)
    d = addresses(dst, stride_d, blk_d, rel_d)
    n = np.broadcast_to(nn[None], (num_regions, *nn.shape)).reshape(-1)
    reg = np.repeat(np.arange(num_regions), nn.size)
    return CopyPlan(*_merge_runs(s, d, n, reg))


def whole_blocks(src: KVLayout, dst: KVLayout, heads: range, start: int, end: int) -> bool:
    """Whether tokens [start, end) of `heads` are whole blocks that both sides store alike
    (one block stride for all regions of a side): each block then copies as one byte range
    per region into one block."""
    bs = src.block_size
    return (
        bs == dst.block_size
        and start % bs == 0
        and end % bs == 0
        and heads == range(src.first_head, src.first_head + src.num_heads)
        and heads == range(dst.first_head, dst.first_head + dst.num_heads)
        and src.one_stride
        and dst.one_stride
    )


def descs_per_run(src: KVLayout, dst: KVLayout, heads: range, start: int, end: int) -> int:
    """Descriptors one run of consecutive blocks costs (before any cut by the other side's
    runs): one where both sides tile blocks across regions and the copy is of whole blocks,
    else at least one per region."""
    if src.tiles_blocks and dst.tiles_blocks and whole_blocks(src, dst, heads, start, end):
        return 1
    return len(src.regions)


def _every_region(
    src: KVLayout, dst: KVLayout, rel_s: np.ndarray, rel_d: np.ndarray, n: np.ndarray
) -> CopyPlan:
    """Rows relative to a region's base (the same in every region, merged already),
    repeated at each region's base, region by region."""
    base_s, base_d = _geometry(src).bases, _geometry(dst).bases
    s = (base_s[:, None] + rel_s[None, :]).reshape(-1)
    d = (base_d[:, None] + rel_d[None, :]).reshape(-1)
    return CopyPlan(s, d, np.tile(n, len(src.regions)))


def _merge_runs(
    s: np.ndarray, d: np.ndarray, n: np.ndarray, reg: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge rows where both source and destination continue exactly where the previous row
    ended (and, given `reg`, within one region)."""
    if len(s) == 0:
        return s, d, n
    starts = np.ones(len(s), dtype=bool)
    starts[1:] = (s[1:] != s[:-1] + n[:-1]) | (d[1:] != d[:-1] + n[:-1])
    if reg is not None:
        starts[1:] |= reg[1:] != reg[:-1]
    idx = np.flatnonzero(starts)
    return s[idx], d[idx], np.add.reduceat(n, idx)


def digest(layout: KVLayout, block_ids: list[int], start: int, end: int, heads: range) -> bytes:
    """Hash tokens [start, end) of `heads` in an order no layout changes (region, token, head,
    part), so prefill and decode can compare what was sent with what landed. DRAM only."""
    if layout.mem_type != "DRAM":
        raise ValueError("checksums read host memory; this layout is in VRAM")
    h = hashlib.sha256()
    if start >= end:
        return h.digest()
    hb, bs, parts, eb = layout.head_bytes, layout.block_size, layout.num_parts, layout.elem_bytes
    t = np.arange(start, end, dtype=np.int64)
    # Byte offset of every (token, head, part, element byte) inside its block, in that order.
    blk = np.asarray(block_ids, dtype=np.int64)[t // bs].reshape(-1, 1, 1, 1)
    pos = (t % bs).reshape(-1, 1, 1, 1)
    head = np.arange(heads.start, heads.stop, dtype=np.int64).reshape(1, -1, 1, 1)
    head = head - layout.first_head
    part = np.arange(parts, dtype=np.int64).reshape(1, 1, -1, 1)
    byte = np.arange(hb, dtype=np.int64).reshape(1, 1, 1, -1)
    if layout.head_major:
        base = (head * parts + part) * bs * hb
        dim_major = np.isin(part, layout.dim_major_parts)
        by_dim = base + (byte // eb * bs + pos) * eb + byte % eb
        inner = np.where(dim_major, by_dim, base + pos * hb + byte)
    else:
        inner = (pos * layout.num_heads + head) * hb + byte
    for region in layout.regions:
        mem = np.ctypeslib.as_array(
            (ctypes.c_uint8 * layout.region_num_bytes).from_address(region.base_addr)
        )
        h.update(mem[(blk * region.block_stride_bytes + inner).reshape(-1)].tobytes())
    return h.digest()
