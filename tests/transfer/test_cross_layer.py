"""Block-outer ("cross-layer") KV layouts over real NIXL/UCX on DRAM: every layer's slice
of a block side by side in one buffer (vLLM's BLHNC), so a run of whole blocks is one
descriptor for all regions, not one per region."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpush.transfer.wire import PrefillAddress
from tests.transfer.conftest import SPEC, assert_idle, decode_config, free_port, prefill_config
from tests.transfer.test_faults import sides
from tests.transfer.test_push import push

pytestmark = pytest.mark.nixl  # NIXL over UCX, a process per endpoint

__all__ = ["sides"]  # the fixture, shared with test_faults
CROSS = replace(SPEC, cross_layer=True, num_regions=8)


def test_a_run_of_whole_blocks_is_one_write_descriptor_and_lands_byte_exact(sides):
    port = free_port()
    prefill = sides("prefill", prefill_config(port), CROSS)
    decode = sides("decode", decode_config(), CROSS)
    address = PrefillAddress("127.0.0.1", port)
    assert push(prefill, decode, address, [1, 2, 3, 4], [10, 11, 12, 13], 64).num_descs == 1
    # fragmented: one per run of both sides ([20, 21] [30] [40, 41])
    out = push(prefill, decode, address, [5, 6, 7, 8, 9], [20, 21, 30, 40, 41], 80)
    assert out.num_descs == 3
    # a cached prefix that ends mid-block is cut inside blocks: one per region and piece again
    out = push(prefill, decode, address, [0, 1, 2, 3], [50, 51, 52, 53], 60, cached=24)
    assert out.num_descs >= CROSS.num_regions
    assert_idle(prefill, decode)


def test_a_cross_layer_side_pairs_with_a_layer_outer_one(sides):
    port = free_port()
    prefill = sides("prefill", prefill_config(port), CROSS)
    decode = sides("decode", decode_config(), replace(CROSS, cross_layer=False))
    out = push(prefill, decode, PrefillAddress("127.0.0.1", port), [1, 2], [7, 8], 32)
    # one per block and region: a region's blocks are not adjacent on the cross-layer side
    assert out.num_descs == 2 * CROSS.num_regions
    assert_idle(prefill, decode)


def test_staging_counts_one_descriptor_per_run_where_both_sides_tile_blocks(sides):
    port = free_port()
    staged = {"staging_bytes": 1 << 20, "staging_min_descs": 3}
    prefill = sides("prefill", prefill_config(port, **staged), CROSS)
    decode = sides("decode", decode_config(**staged), CROSS)
    address = PrefillAddress("127.0.0.1", port)
    # two runs are two descriptors (not 2 x 8 regions): below the threshold, direct
    assert push(prefill, decode, address, [1, 2, 3], [10, 11, 30], 48).num_descs == 2
    assert [s.call("counters")["staged"] for s in (prefill, decode)] == [0, 0]
    # three runs reach it: gathered from the interleaved buffer, one WRITE, scattered
    assert push(prefill, decode, address, [1, 2, 3], [10, 20, 30], 48).num_descs == 1
    assert [s.call("counters")["staged"] for s in (prefill, decode)] == [1, 1]
    assert_idle(prefill, decode)
