"""Copy plans: descriptor counts, and byte-exact landing checked against the reference."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest

from kvpush.bench.harness import LayoutSpec, Memory, fill_pattern, host_addresses
from kvpush.transfer.layout import digest, plan_copies, rank_heads, writer_heads
from tests.transfer.reference import expected_after_push


def apply(plan, src_arrays, dst_arrays, src_layout, dst_layout):
    """Carry out a plan with memcpy inside this process (the NIXL tests do it for real)."""
    out = [a.copy() for a in dst_arrays]
    for s, d, n in zip(plan.src_addrs, plan.dst_addrs, plan.num_bytes, strict=True):
        rs = _region_of(src_layout, src_arrays, s)
        rd = _region_of(dst_layout, dst_arrays, d)
        so = int(s - src_layout.regions[rs].base_addr)
        do = int(d - dst_layout.regions[rd].base_addr)
        assert rs == rd, "a descriptor crossed regions"
        out[rd][do : do + n] = src_arrays[rs][so : so + n]
    return out


def _region_of(layout, arrays, addr):
    (idx,) = [
        i
        for i, (r, a) in enumerate(zip(layout.regions, arrays, strict=True))
        if r.base_addr <= addr < r.base_addr + a.nbytes
    ]
    return idx


def check(src_spec, dst_spec, src_ids, dst_ids, start, end, heads=None, pad_tail=False):
    src = fill_pattern(src_spec, 7)
    dst = [np.full(dst_spec.region_num_bytes, 0xEE, np.uint8) for _ in range(dst_spec.num_regions)]
    # Fresh arrays keep their addresses for the plan and the apply step alike.
    src_layout, dst_layout = (
        src_spec.build(host_addresses(src)),
        dst_spec.build(host_addresses(dst)),
    )
    heads = heads or range(dst_spec.first_head, dst_spec.first_head + dst_spec.num_heads)
    plan = plan_copies(src_layout, dst_layout, src_ids, dst_ids, start, end, heads, pad_tail)
    got = apply(plan, src, dst, src_layout, dst_layout)
    if pad_tail and src_spec.block_size == dst_spec.block_size:
        end = -(-end // src_spec.block_size) * src_spec.block_size
    want = expected_after_push(src, dst, src_spec, dst_spec, src_ids, dst_ids, start, end, heads)
    # What decode holds of [start, end) hashes the same as what prefill sent.
    landed = dst_spec.build(host_addresses(got))
    assert digest(src_layout, src_ids, start, end, heads) == digest(
        landed, dst_ids, start, end, heads
    )
    assert (
        digest(src_layout, src_ids, start, end, heads)
        != digest(dst_layout, dst_ids, start, end, heads)
        or start == end
    ), "the digest cannot tell landed data from the sentinel"
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)
    return plan


BASE = LayoutSpec(num_blocks=32, block_size=16, num_heads=2, head_bytes=8)


@pytest.mark.parametrize("head_major", [True, False])
def test_contiguous_run_is_one_descriptor_per_region(head_major):
    spec = replace(BASE, head_major=head_major)
    plan = check(spec, spec, [3, 4, 5, 6], [10, 11, 12, 13], 0, 64)
    assert plan.num_descs == spec.num_regions


@pytest.mark.parametrize("head_major", [True, False])
def test_fragmented_run_is_one_descriptor_per_piece_per_region(head_major):
    spec = replace(BASE, head_major=head_major)
    # destination broken into 3 runs: [10, 11] [20] [5, 6]
    plan = check(spec, spec, [1, 2, 3, 4, 5], [10, 11, 20, 5, 6], 0, 80)
    assert plan.num_descs == 3 * spec.num_regions


def test_head_split_is_at_most_one_descriptor_per_destination_block_per_region():
    prefill = replace(BASE, num_heads=4, total_heads=4)
    decode1 = replace(BASE, num_heads=2, first_head=2, total_heads=4)
    plan = check(prefill, decode1, [0, 1, 2, 3], [7, 8, 9, 10], 0, 64, range(2, 4))
    assert plan.num_descs <= 4 * BASE.num_regions


def test_head_gather_two_prefill_ranks_fill_one_decode_rank():
    decode = replace(BASE, num_heads=4, total_heads=4)
    for rank in range(2):
        prefill = replace(BASE, num_heads=2, first_head=2 * rank, total_heads=4)
        heads = range(2 * rank, 2 * rank + 2)
        plan = check(prefill, decode, [0, 1], [5, 6], 0, 32, heads)
        assert plan.num_descs <= 2 * 2 * BASE.num_regions  # per dst block: one per head


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 32), (32, 16)])
def test_block_size_change_head_major(src_bs, dst_bs):
    src, dst = replace(BASE, block_size=src_bs), replace(BASE, block_size=dst_bs)
    n_src, n_dst = 128 // src_bs, 128 // dst_bs
    plan = check(src, dst, list(range(n_src)), list(range(3, 3 + n_dst)), 0, 128)
    # Head-major rows of different lengths cannot merge across heads: one descriptor per
    # (source block x destination block overlap, head) per region, never more.
    pieces = max(n_src, n_dst)
    assert plan.num_descs <= pieces * BASE.num_heads * BASE.num_regions


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 32), (32, 16)])
def test_block_size_change_token_major_is_one_per_destination_block(src_bs, dst_bs):
    src = replace(BASE, block_size=src_bs, head_major=False)
    dst = replace(BASE, block_size=dst_bs, head_major=False)
    n_src, n_dst = 128 // src_bs, 128 // dst_bs
    plan = check(src, dst, list(range(n_src)), [9, 2, 30, 4, 5, 6, 7, 8][:n_dst], 0, 128)
    assert plan.num_descs <= n_dst * BASE.num_regions


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("cached", [0, 16, 24, 47, 48])
def test_cached_prefix_is_skipped_even_mid_block(head_major, cached):
    src = replace(BASE, block_size=16, head_major=head_major)
    dst = replace(BASE, block_size=32, head_major=head_major)
    # decode already holds `cached` tokens; nothing before them may change
    plan = check(src, dst, [0, 1, 2, 3], [4, 5], cached, 60)
    assert plan.total_bytes == (60 - cached) * BASE.num_heads * BASE.head_bytes * 2


def test_nothing_to_write_is_an_empty_plan():
    assert check(BASE, BASE, [1, 2], [3, 4], 32, 32).num_descs == 0


def test_bad_block_ids_are_refused_with_the_limit():
    src = fill_pattern(BASE, 1)
    layout = BASE.build(host_addresses(src))
    with pytest.raises(ValueError, match="out of range 0..31"):
        plan_copies(layout, layout, [0, 1], [0, 99], 0, 32)
    with pytest.raises(ValueError, match="need 2"):
        plan_copies(layout, layout, [0], [0, 1], 0, 32)


@pytest.mark.parametrize(
    ("decode_tp", "prefill_tp", "heads", "want"),
    [
        (2, 1, 4, [{0: range(0, 2)}, {0: range(2, 4)}]),
        (1, 2, 4, [{0: range(0, 2), 1: range(2, 4)}]),
        (1, 1, 4, [{0: range(0, 4)}]),
        (2, 8, 2, [{0: range(0, 1)}, {4: range(1, 2)}]),  # replicated prefill heads: one writer
    ],
)
def test_which_prefill_rank_writes_which_heads(decode_tp, prefill_tp, heads, want):
    got = [
        writer_heads(rank_heads(d, decode_tp, heads), prefill_tp, heads) for d in range(decode_tp)
    ]
    assert got == want


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(32, 32), (32, 64), (64, 32)])
def test_k_and_v_side_by_side_in_each_head_as_vllm_cpu_lays_them(src_bs, dst_bs):
    """vLLM's CPU backend: a block is [head][K tokens][V tokens]."""
    src = replace(BASE, block_size=src_bs, num_parts=2, num_regions=4)
    dst = replace(BASE, block_size=dst_bs, num_parts=2, num_regions=4)
    n_src, n_dst = 192 // src_bs, 192 // dst_bs
    plan = check(src, dst, list(range(n_src)), list(range(10, 10 + n_dst)), 40, 192)
    assert plan.total_bytes == (192 - 40) * BASE.num_heads * 2 * BASE.head_bytes * 4
    if src_bs == dst_bs:  # whole blocks merge across heads and parts
        assert plan.num_descs <= (1 + 2 * 2) * 4  # the partial first block, then one run


VLLM_CPU = replace(
    BASE, head_bytes=16, elem_bytes=4, num_parts=2, dim_major_parts=(0,), num_regions=2
)


@pytest.mark.parametrize(
    ("src_bs", "dst_bs", "start"), [(32, 32, 0), (32, 64, 0), (64, 32, 32), (32, 64, 40)]
)
def test_k_stored_dimension_by_dimension_lands_exactly(src_bs, dst_bs, start):
    """vLLM's CPU backend keeps K as [dim][token] and V as [token][dim] in each head."""
    src, dst = replace(VLLM_CPU, block_size=src_bs), replace(VLLM_CPU, block_size=dst_bs)
    plan = check(
        src, dst, list(range(192 // src_bs)), list(range(5, 5 + 192 // dst_bs)), start, 150
    )
    assert plan.total_bytes == (150 - start) * 2 * 2 * 16 * 2


def test_equal_block_sizes_copy_whole_blocks_when_padding_the_tail():
    spec = replace(VLLM_CPU, block_size=32)
    plan = check(spec, spec, [0, 1, 2], [7, 8, 9], 0, 70, pad_tail=True)
    assert plan.num_descs == spec.num_regions  # three whole blocks, one run per region
    unpadded = check(spec, spec, [0, 1, 2], [7, 8, 9], 0, 70)
    assert unpadded.num_descs >= 10 * spec.num_regions  # K dim by dim in the partial tail


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize(
    "src_ids,dst_ids,start",
    [
        (list(range(8)), list(range(8, 16)), 0),  # contiguous
        ([0, 1, 5, 6, 7, 2, 3, 4], [9, 8, 10, 11, 20, 21, 3, 2], 0),  # fragmented
        ([4, 5, 6, 7, 0, 1, 2, 3], list(range(16, 24)), 32),  # cached prefix, whole blocks
    ],
)
def test_whole_block_fast_path_plans_what_the_general_path_plans(
    monkeypatch, head_major, src_ids, dst_ids, start
):
    spec = replace(BASE, head_major=head_major)
    check(spec, spec, src_ids, dst_ids, start, 128)  # byte-exact, through the fast path
    from kvpush.transfer import layout

    # The same plan row for row, on fixed addresses, with the fast path and without it.
    src = spec.build([1 << 20, 3 << 20])
    dst = spec.build([5 << 20, 7 << 20])
    fast = plan_copies(src, dst, src_ids, dst_ids, start, 128)
    monkeypatch.setattr(layout, "whole_blocks", lambda *args: False)
    general = plan_copies(src, dst, src_ids, dst_ids, start, 128)
    for got, want in zip(
        (fast.src_addrs, fast.dst_addrs, fast.num_bytes),
        (general.src_addrs, general.dst_addrs, general.num_bytes),
        strict=True,
    ):
        assert np.array_equal(got, want)


def land(src_spec, dst_spec, src_ids, dst_ids, start, end, heads=None, pad_tail=False):
    """Carry out a plan with memmove on the harness's own memory (interleaved block by block
    for a cross-layer spec) and check decode's regions against the reference."""
    src, dst = Memory(src_spec, 7), Memory(dst_spec, None)
    src_layout, dst_layout = src_spec.build(src.addresses()), dst_spec.build(dst.addresses())
    heads = heads or range(dst_spec.first_head, dst_spec.first_head + dst_spec.num_heads)
    plan = plan_copies(src_layout, dst_layout, src_ids, dst_ids, start, end, heads, pad_tail)
    before = dst.read()
    for s, d, n in zip(plan.src_addrs, plan.dst_addrs, plan.num_bytes, strict=True):
        ctypes.memmove(int(d), int(s), int(n))
    if pad_tail and src_spec.block_size == dst_spec.block_size:
        end = -(-end // src_spec.block_size) * src_spec.block_size
    want = expected_after_push(
        src.read(), before, src_spec, dst_spec, src_ids, dst_ids, start, end, heads
    )
    for got, exp in zip(dst.read(), want, strict=True):
        assert np.array_equal(got, exp)
    return plan


CROSS = replace(BASE, cross_layer=True, num_regions=4)


def test_cross_layer_layouts_tile_blocks_and_layer_outer_ones_do_not():
    mem = Memory(CROSS, None)
    assert CROSS.build(mem.addresses()).tiles_blocks
    flat = replace(CROSS, cross_layer=False)
    assert not flat.build(Memory(flat, None).addresses()).tiles_blocks


@pytest.mark.parametrize("head_major", [True, False])
def test_cross_layer_run_of_whole_blocks_is_one_descriptor_for_every_region(head_major):
    spec = replace(CROSS, head_major=head_major)
    assert land(spec, spec, [3, 4, 5, 6], [10, 11, 12, 13], 0, 64).num_descs == 1
    # fragmented: one per run of both sides ([10, 11] [20] [5, 6]), not one per region too
    assert land(spec, spec, [1, 2, 3, 4, 5], [10, 11, 20, 5, 6], 0, 80).num_descs == 3
    # a partial tail goes whole when padded; a cached prefix of whole blocks is skipped
    assert land(spec, spec, [0, 1, 2], [7, 8, 9], 0, 40, pad_tail=True).num_descs == 1
    assert land(spec, spec, [0, 1, 2, 3], [20, 21, 9, 10], 32, 64).num_descs == 1


@pytest.mark.parametrize(
    "src_spec,dst_spec,start,end",
    [
        (CROSS, CROSS, 24, 64),  # cached prefix mid-block: not whole blocks
        (CROSS, replace(CROSS, block_size=32), 0, 64),  # block size change
        (replace(CROSS, block_size=32), CROSS, 0, 64),
        (CROSS, replace(CROSS, cross_layer=False), 0, 64),  # one side layer-outer
        (replace(CROSS, cross_layer=False), CROSS, 0, 64),
    ],
)
def test_cross_layer_layouts_land_exactly_where_blocks_are_cut(src_spec, dst_spec, start, end):
    plan = land(src_spec, dst_spec, [0, 1, 2, 3], [9, 8, 7, 6], start, end)
    assert plan.num_descs >= CROSS.num_regions  # per region again


def test_cross_layer_tp_split_and_gather_land_exactly():
    prefill = replace(CROSS, num_heads=4, total_heads=4)
    for first in (0, 2):
        decode = replace(CROSS, num_heads=2, first_head=first, total_heads=4)
        land(prefill, decode, [0, 1], [5, 6], 0, 32)
    whole = replace(CROSS, num_heads=4, total_heads=4)
    half = replace(CROSS, num_heads=2, first_head=2, total_heads=4)
    land(half, whole, [0, 1], [5, 6], 0, 32, heads=range(2, 4))
