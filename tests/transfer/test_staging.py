"""Staged pushes (kvpush.transfer.staging): gather into a slot, one WRITE, scatter.

Staging is off on DRAM by default (its place is VRAM, test_gpu.py runs it there); these
tests turn it on for real endpoints over NIXL/UCX on DRAM, where the copies are memmoves,
so the protocol, the slot bookkeeping and every layout change run in the CPU suite.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpush.transfer.layout import KVLayout, RegionSpec, plan_copies, plan_regions
from kvpush.transfer.staging import SLOT_ALIGN, Copier, StagingArea, slot_bytes, slot_layout
from kvpush.transfer.wire import PrefillAddress
from tests.transfer.conftest import (
    SPEC,
    assert_idle,
    decode_config,
    free_port,
    prefill_config,
    wait_for,
)
from tests.transfer.test_faults import check_block_sizes, sides, tp1_to_tp2, tp2_to_tp1
from tests.transfer.test_push import new_key, push

pytestmark = pytest.mark.nixl  # NIXL over UCX, a process per endpoint

__all__ = ["sides"]  # the fixture, shared with test_faults
STAGED = {"staging_bytes": 1 << 20, "staging_min_descs": 1}  # every push with 1+ runs


@pytest.fixture(scope="module")
def staged_pair():
    from kvpush.bench.harness import Side

    port = free_port()
    prefill = Side("prefill", prefill_config(port, **STAGED), SPEC, seed=11)
    decode = Side("decode", decode_config(**STAGED), SPEC)
    yield prefill, decode, PrefillAddress("127.0.0.1", port)
    prefill.close()
    decode.close()


def counters(*sides) -> list[dict]:
    return [s.call("counters") for s in sides]


def test_the_area_hands_out_aligned_slots_first_fit_and_merges_what_comes_back():
    area = StagingArea(4 * SLOT_ALIGN, "DRAM")
    a = area.reserve(1)
    b = area.reserve(SLOT_ALIGN + 1)  # rounded up to two units
    assert (a - area.base_addr, b - area.base_addr) == (0, SLOT_ALIGN)
    assert area.held_bytes == 3 * SLOT_ALIGN
    assert area.reserve(2 * SLOT_ALIGN) is None  # one unit left
    area.release(a)
    area.release(b)
    assert area.held_bytes == 0
    assert area.reserve(4 * SLOT_ALIGN) == area.base_addr  # the pieces merged again
    with pytest.raises(KeyError):
        area.release(area.base_addr + SLOT_ALIGN)  # not a slot's start


def test_gather_then_scatter_through_a_slot_equals_the_direct_plan():
    """Without NIXL: the two copy plans through a slot move the same bytes as one plan."""
    rng = np.random.default_rng(3)
    kw = dict(num_blocks=8, block_size=4, num_heads=2, head_bytes=8, head_major=True)
    src_mem = [rng.integers(0, 256, 8 * 64, dtype=np.uint8) for _ in range(2)]
    direct_mem = [np.zeros(8 * 64, np.uint8) for _ in range(2)]
    staged_mem = [np.zeros(8 * 64, np.uint8) for _ in range(2)]

    def layout(mem):
        return KVLayout(tuple(RegionSpec(m.ctypes.data, 64) for m in mem), **kw)

    src, direct, dst = layout(src_mem), layout(direct_mem), layout(staged_mem)
    src_ids, dst_ids, heads = [5, 1, 6, 2], [0, 7, 3, 4], range(1, 2)
    Copier("DRAM").run(plan_regions(src, direct, src_ids, dst_ids, 3, 14, heads))
    probe, _ = slot_layout(0, dst, heads, 3, 14)
    area = StagingArea(slot_bytes(probe), "DRAM")
    slot = area.reserve(slot_bytes(probe))
    stage, ids = slot_layout(slot, dst, heads, 3, 14)
    Copier("DRAM").run(plan_regions(src, stage, src_ids, ids, 3, 14, heads))
    Copier("DRAM").run(plan_regions(stage, dst, ids, dst_ids, 3, 14, heads))
    for a, b in zip(direct_mem, staged_mem, strict=True):
        assert np.array_equal(a, b)
    assert (direct_mem[0] != 0).any()  # something was copied at all


@pytest.mark.parametrize("strides", [(64, 64, 64), (64, 96, 64)])
def test_a_plan_factored_by_region_has_the_rows_of_the_whole_plan(strides):
    """plan_regions builds one region's rows and the bases; expanded, they are exactly
    plan_copies' rows (same order); with unequal strides it falls back to the whole plan."""

    def layout(base, strides):
        regions = tuple(RegionSpec(base + i * 10_000, st) for i, st in enumerate(strides))
        return KVLayout(regions, 16, 4, 2, 8, True)

    src, dst = layout(1 << 20, strides), layout(1 << 24, (64, 64, 64))
    args = ([5, 1, 6, 2, 9], [0, 7, 3, 4, 8], 3, 18, range(0, 2))
    factored, whole = plan_regions(src, dst, *args), plan_copies(src, dst, *args)
    assert len(factored.src_bases) == (3 if len(set(strides)) == 1 else 1)
    flat = factored.absolute()
    for got, want in zip(
        (flat.src_addrs, flat.dst_addrs, flat.num_bytes),
        (whole.src_addrs, whole.dst_addrs, whole.num_bytes),
        strict=True,
    ):
        assert np.array_equal(got, want)
    assert factored.total_bytes == whole.total_bytes


def test_scattered_blocks_go_as_one_write_and_land_byte_exact(staged_pair):
    prefill, decode, address = staged_pair
    before = counters(prefill, decode)
    out = push(prefill, decode, address, [5, 9, 7, 8, 30], [20, 41, 30, 3, 12], 80)
    assert out.num_descs == 1  # the slot, not 5 runs x 2 regions
    assert out.num_bytes == 80 * SPEC.num_heads * SPEC.head_bytes * SPEC.num_regions
    after = counters(prefill, decode)
    assert [a["staged"] - b["staged"] for a, b in zip(after, before, strict=True)] == [1, 1]
    assert_idle(prefill, decode)  # staging_held_bytes back to 0 on both sides


@pytest.mark.parametrize("order", ["register", "prefill-first"])
@pytest.mark.parametrize("cached", [0, 24])
def test_staged_push_keeps_a_cached_prefix_and_either_arrival_order(staged_pair, order, cached):
    prefill, decode, address = staged_pair
    decode.call("reset")
    push(prefill, decode, address, [0, 4, 2, 9], [50, 51, 8, 53], 60, cached, order)
    assert_idle(prefill, decode)


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 32), (32, 16), (16, 64), (64, 16)])
def test_staged_push_changes_block_size_token_exact(sides, src_bs, dst_bs):
    prefill, decode = check_block_sizes(sides, src_bs, dst_bs, **STAGED)
    assert [c["staged"] for c in counters(prefill, decode)] == [1, 1]
    assert_idle(prefill, decode)


def test_staged_push_splits_heads_from_tp1_to_tp2(sides):
    started = tp1_to_tp2(sides, **STAGED)
    assert [c["staged"] for c in counters(*started)] == [2, 1, 1]  # one WRITE per decode rank
    assert_idle(*started)


def test_staged_push_gathers_heads_from_tp2_to_tp1(sides):
    started = tp2_to_tp1(sides, **STAGED)
    assert [c["staged"] for c in counters(*started)] == [1, 1, 2]  # one slot per prefill rank
    assert_idle(*started)


def test_a_staged_write_that_lands_after_the_cancel_is_neither_scattered_nor_checked(sides):
    """Decode's loop is held (the harness's "stall") while it is told to cancel and prefill
    writes: it then sees the cancel before the WRITE's notification."""
    port = free_port()
    checked = STAGED | {"debug_checksum": True}
    prefill = sides("prefill", prefill_config(port, **checked))
    decode = sides("decode", decode_config(**checked))
    decode.call("reset")
    key = new_key()
    fd = decode.call("expect", key, PrefillAddress("127.0.0.1", port), [1, 9, 4], 48)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "the registration")
    stall = decode.call("stall", 1.0)
    cancel = decode.call("cancel", key)  # queued behind the stall
    pushed = prefill.call("push", key, [2, 3, 6], 48)
    decode.wait(stall)
    assert decode.wait(cancel, timeout_s=5).ok and not decode.wait(fd).ok
    prefill.wait(pushed)
    assert counters(prefill)[0]["staged"] == 1  # it was written, into decode's slot
    got = counters(decode)[0]
    assert (got["staged"], got["checksum_mismatches"], got["checksums_ok"]) == (0, 0, 0)
    assert all((r == 0xEE).all() for r in decode.call("regions")), "a cancelled block was written"
    assert_idle(prefill, decode)


def test_few_descriptors_go_direct(sides):
    port = free_port()
    more = STAGED | {"staging_min_descs": 1000}
    prefill = sides("prefill", prefill_config(port, **more))
    decode = sides("decode", decode_config(**more))
    out = push(prefill, decode, PrefillAddress("127.0.0.1", port), [1, 5], [7, 3], 32)
    assert out.num_descs == 2 * SPEC.num_regions
    assert [c["staged"] for c in counters(prefill, decode)] == [0, 0]
    assert_idle(prefill, decode)


@pytest.mark.parametrize("full", ["prefill", "decode"])
def test_a_push_that_finds_no_slot_free_goes_direct(sides, full):
    """A slot too small for the push on one side: nothing is staged, all of it lands."""
    port = free_port()
    tiny = STAGED | {"staging_bytes": SLOT_ALIGN}
    prefill = sides("prefill", prefill_config(port, **(tiny if full == "prefill" else STAGED)))
    decode = sides("decode", decode_config(**(tiny if full == "decode" else STAGED)))
    out = push(prefill, decode, PrefillAddress("127.0.0.1", port), [1, 5, 9], [7, 3, 11], 48)
    assert out.num_descs == 3 * SPEC.num_regions
    p, d = counters(prefill, decode)
    assert (p["staged"], d["staged"]) == (0, 0)
    assert (p["staging_full"], d["staging_full"]) == ((1, 0) if full == "prefill" else (0, 1))
    counted = {"staged:full": 1}  # in kvpush:fallbacks, on the side that had no room
    expected = (counted, {}) if full == "prefill" else ({}, counted)
    assert (prefill.call("fallbacks"), decode.call("fallbacks")) == expected
    assert_idle(prefill, decode)


def test_a_gather_that_fails_goes_direct_and_frees_its_slot(sides):
    """Fault injected in prefill's child (the harness's "gather-fails"): its copies raise."""
    port = free_port()
    prefill = sides("prefill", prefill_config(port, **STAGED), fault="gather-fails")
    decode = sides("decode", decode_config(**STAGED))
    out = push(prefill, decode, PrefillAddress("127.0.0.1", port), [1, 5, 9], [7, 3, 11], 48)
    assert out.num_descs == 3 * SPEC.num_regions
    p, d = counters(prefill, decode)
    assert (p["staging_errors"], p["staged"], d["staged"]) == (1, 0, 0)
    assert prefill.call("fallbacks") == {"staged:error": 1}
    assert_idle(prefill, decode)  # both slots free again


def test_an_endpoint_without_memory_for_staging_runs_every_push_direct(sides):
    """Fault injected in decode's child (the harness's "no-staging-memory")."""
    port = free_port()
    prefill = sides("prefill", prefill_config(port, **STAGED))
    decode = sides("decode", decode_config(**STAGED), fault="no-staging-memory")
    out = push(prefill, decode, PrefillAddress("127.0.0.1", port), [1, 5], [7, 3], 32)
    assert out.num_descs == 2 * SPEC.num_regions
    assert counters(prefill)[0]["staged"] == 0
    assert_idle(prefill, decode)


@pytest.mark.parametrize("size", [-1, 1, SLOT_ALIGN - 1])
def test_a_staging_area_smaller_than_a_slot_is_refused(size):
    with pytest.raises(ValueError, match="staging_bytes must be 0"):
        decode_config(staging_bytes=size)


def test_staging_on_one_side_only_goes_direct(sides):
    port = free_port()
    prefill = sides("prefill", prefill_config(port))  # DRAM default: no staging area
    decode = sides("decode", decode_config(**STAGED))
    out = push(prefill, decode, PrefillAddress("127.0.0.1", port), [1, 5], [7, 3], 32)
    assert out.num_descs == 2 * SPEC.num_regions
    assert counters(decode)[0]["staged"] == 0
    assert_idle(prefill, decode)


def test_a_cancelled_staged_registration_frees_its_slot(staged_pair):
    prefill, decode, address = staged_pair
    decode.call("reset")
    key = new_key()
    fd = decode.call("expect", key, address, [1, 9, 4], 48)
    wait_for(lambda: decode.call("gauges")["staging_held_bytes"] > 0, 5, "a slot reserved")
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "the registration")
    assert decode.wait(decode.call("cancel", key), timeout_s=5).ok
    assert not decode.wait(fd).ok
    time.sleep(0.2)
    # prefill's late source finds the key cancelled: nothing is gathered or written
    out = prefill.wait(prefill.call("push", key, [2, 3, 6], 48), timeout_s=5)
    assert not out.ok and "cancelled" in out.reason, out
    assert all((r == 0xEE).all() for r in decode.call("regions")), "a cancelled block was written"
    assert_idle(prefill, decode)


@pytest.mark.parametrize("offset", [0, 3])  # 8-byte words, or bytes
def test_the_batch_copy_kernel_in_tritons_interpreter(monkeypatch, offset):
    """The staged path's kernel (kvpush.transfer.batchcopy), its own source, run on CPU
    tensors by Triton's interpreter (TRITON_INTERPRET=1): addresses from region bases plus
    rows, word sizes, masks, the rows x regions grid. Not its speed, nor CUDA streams:
    test_gpu.py runs it on the GPU."""
    import torch

    from kvpush.transfer import batchcopy

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = batchcopy._build()  # decorated now: the interpreter's kernel
    src = torch.randint(0, 256, (3, 8192), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    rel_s = np.array([0, 1024, 3000, 5000]) + offset
    rel_d, n = np.array([2048, 0, 3072, 6000]), np.array([512, 8, 96, 1600])
    bases_s = [src[i].data_ptr() for i in range(3)]
    bases_d = [dst[i].data_ptr() for i in range(3)]
    # rows over 1,024 bytes go in pieces (here the 1,600-byte row: 1,024 + 576)
    packed, word, num_rows = batchcopy.pack(rel_s, rel_d, n, bases_s, bases_d, 1024)
    assert (word, num_rows) == (8 if offset == 0 else 1, len(n) + 1)
    batchcopy.launch(kernel, torch.from_numpy(packed), num_rows, word, 64, 4)  # 16 steps a row
    want = torch.zeros_like(src)
    for r in range(3):
        for s, d, k in zip(rel_s, rel_d, n, strict=True):
            want[r, d : d + k] = src[r, s : s + k]
    assert torch.equal(dst, want)  # every row in every region, and nothing else


def test_long_rows_are_cut_into_pieces_that_cover_them_exactly():
    from kvpush.transfer.batchcopy import split_rows

    src, dst, n = np.array([0, 10_000]), np.array([50_000, 90_000]), np.array([24, 2_056])
    s, d, k = split_rows(src, dst, n, 1024)
    assert s.tolist() == [0, 10_000, 11_024, 12_048]
    assert d.tolist() == [50_000, 90_000, 91_024, 92_048]
    assert k.tolist() == [24, 1024, 1024, 8]
    same = split_rows(src, dst, n, 4096)
    assert all(a is b for a, b in zip(same, (src, dst, n), strict=True))  # nothing to cut
