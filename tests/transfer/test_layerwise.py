"""PrefillEndpoint.computed(): a push written layer by layer while prefill computes.

Real endpoints in their own processes with NIXL agents over UCX; four regions (layers), so
that pieces go out before the push. Every test checks decode's memory byte for byte or that
nothing is held afterwards.
"""

from __future__ import annotations

import time

import pytest

from kvpush.bench.harness import Side
from kvpush.transfer.wire import PrefillAddress
from tests.transfer.conftest import (
    assert_idle,
    decode_config,
    endpoints,
    free_port,
    give_up,
    prefill_config,
    spec,
    wait_for,
)
from tests.transfer.test_push import assert_landed, new_key

pytestmark = pytest.mark.nixl  # NIXL over UCX, a process per endpoint

LAYERS = spec(num_regions=4)


@pytest.fixture(scope="module")
def quad():
    yield from endpoints(LAYERS, 23)


def _count(prefill, name: str) -> int:
    return prefill.call("counters")[name]


def _registered(prefill, decode, address, key, dst_ids, num_tokens, cached=0):
    fd = decode.call("expect", key, address, dst_ids, num_tokens, cached)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    return fd


def _layers(prefill, key, *regions):
    """computed() once per layer, as the worker calls it, each acted on before the next."""
    for r in regions:
        prefill.wait(prefill.call("computed", [key], [r]))


def test_layers_written_before_the_push_land_byte_exact_with_its_first_token(quad):
    prefill, decode, address = quad
    src, before = prefill.call("regions"), decode.call("regions")
    writes = _count(prefill, "layer_writes")
    key = new_key()
    fd = _registered(prefill, decode, address, key, [30, 31, 33], 40)
    prefill.wait(prefill.call("prepare", key, [4, 5, 6], 40))
    _layers(prefill, key, 0, 1, 2, 3)
    # regions 0-2 went out as they were computed; the last one waits for the push, whose
    # WRITE carries the notification, so decode has not finished yet
    assert _count(prefill, "layer_writes") == writes + 3
    assert not decode.call("done", fd)
    out_p = prefill.wait(prefill.call("push", key, [4, 5, 6], 40, 7))
    out_d = decode.wait(fd)
    assert out_p.ok and out_d.ok and out_d.first_token == 7, (out_p, out_d)
    assert out_p.num_bytes == 4 * 3 * LAYERS.block_bytes  # every region, pieces included
    assert_landed(prefill, decode, src, before, [4, 5, 6], [30, 31, 33], 40)
    assert_idle(prefill, decode)


def test_layers_computed_out_of_order_are_written_in_order(quad):
    """Region 2 first: nothing can go before regions 0 and 1 are in."""
    prefill, decode, address = quad
    src, before = prefill.call("regions"), decode.call("regions")
    writes = _count(prefill, "layer_writes")
    key = new_key()
    fd = _registered(prefill, decode, address, key, [40, 41], 32, cached=5)
    prefill.wait(prefill.call("prepare", key, [8, 9], 32))
    _layers(prefill, key, 2)
    assert _count(prefill, "layer_writes") == writes
    _layers(prefill, key, 0)
    assert _count(prefill, "layer_writes") == writes + 1  # region 0
    _layers(prefill, key, 1)
    assert _count(prefill, "layer_writes") == writes + 2  # regions 1 and 2 in one piece
    out_p = prefill.wait(prefill.call("push", key, [8, 9], 32))
    assert out_p.ok and decode.wait(fd).ok
    assert_landed(prefill, decode, src, before, [8, 9], [40, 41], 32, cached=5)
    assert_idle(prefill, decode)


def test_a_layer_is_read_only_once_it_is_ready(quad):
    """On a GPU the forward's kernels run after save_kv_layer returns: computed() takes a
    `ready` poll (a CUDA event's query()), and the loop thread, never blocked by it, writes
    the layer only once it says so."""
    prefill, decode, address = quad
    src, before = prefill.call("regions"), decode.call("regions")
    writes = _count(prefill, "layer_writes")
    key = new_key()
    fd = _registered(prefill, decode, address, key, [42, 43], 32)
    prefill.wait(prefill.call("prepare", key, [21, 22], 32))
    prefill.call("computed_after", [key], [0], 0.6)
    _layers(prefill, key, 1)  # ready at once, but behind layer 0, which is not
    time.sleep(0.3)
    assert _count(prefill, "layer_writes") == writes
    start = time.monotonic()  # the loop thread still acts on other work meanwhile
    prefill.wait(prefill.call("prepare", new_key(), [1], 16))
    assert time.monotonic() - start < 0.2
    assert _count(prefill, "layer_writes") == writes
    # ready together, layers 0 and 1 go out as one WRITE
    wait_for(lambda: _count(prefill, "layer_writes") == writes + 1, 5, "layers 0-1 written")
    out_p = prefill.wait(prefill.call("push", key, [21, 22], 32))
    assert out_p.ok and decode.wait(fd).ok
    assert_landed(prefill, decode, src, before, [21, 22], [42, 43], 32)
    assert_idle(prefill, decode)


def test_a_push_from_other_blocks_than_the_layers_is_written_whole(quad):
    prefill, decode, address = quad
    src, before = prefill.call("regions"), decode.call("regions")
    key = new_key()
    fd = _registered(prefill, decode, address, key, [50, 51], 32)
    prefill.wait(prefill.call("prepare", key, [1, 2], 32))
    _layers(prefill, key, 0, 1)
    out_p = prefill.wait(prefill.call("push", key, [11, 12], 32))
    assert out_p.ok and decode.wait(fd).ok
    assert_landed(prefill, decode, src, before, [11, 12], [50, 51], 32)
    assert_idle(prefill, decode)


def test_a_registration_after_the_first_layers_is_written_from_then_on(quad):
    prefill, decode, address = quad
    src, before = prefill.call("regions"), decode.call("regions")
    key = new_key()
    prefill.wait(prefill.call("prepare", key, [13, 14], 32))
    _layers(prefill, key, 0, 1)  # nobody to write to yet
    fd = _registered(prefill, decode, address, key, [52, 53], 32)
    _layers(prefill, key, 2)  # regions 0-2 go now
    out_p = prefill.wait(prefill.call("push", key, [13, 14], 32))
    assert out_p.ok and decode.wait(fd).ok
    assert_landed(prefill, decode, src, before, [13, 14], [52, 53], 32)
    assert_idle(prefill, decode)


def test_a_cancel_after_layers_are_written_is_answered_and_frees_everything(quad):
    """Decode gives its blocks up while they are being written: its cancel is answered only
    once nothing can land in them any more, and the push that follows fails."""
    prefill, decode, address = quad
    key = new_key()
    fd = _registered(prefill, decode, address, key, [54, 55], 32)
    prefill.wait(prefill.call("prepare", key, [15, 16], 32))
    _layers(prefill, key, 0, 1)
    out_c = decode.wait(decode.call("cancel", key), timeout_s=5)
    assert out_c.ok and out_c.reason == "blocks released", out_c
    decode.wait(fd, timeout_s=5)
    out_p = prefill.wait(prefill.call("push", key, [15, 16], 32))
    assert (out_p.ok, out_p.cause) == (False, "cancelled"), out_p
    assert_idle(prefill, decode)


@pytest.mark.parametrize("by", ["scheduler", "router"])
def test_an_abort_after_layers_are_written_fails_decode_and_holds_nothing(quad, by):
    prefill, decode, address = quad
    key = new_key()
    fd = _registered(prefill, decode, address, key, [56, 57], 32)
    prefill.wait(prefill.call("prepare", key, [17, 18], 32))
    _layers(prefill, key, 0, 1, 2)
    give_up(prefill, address, key, by)
    out_d = decode.wait(fd, timeout_s=5)
    assert (out_d.ok, out_d.cause) == (False, "aborted" if by == "scheduler" else "abandoned")
    assert_idle(prefill, decode)


def test_layers_whose_push_never_comes_fail_decode_after_the_lease(quad):
    prefill, decode, address = quad
    key = new_key()
    fd = _registered(prefill, decode, address, key, [58, 59], 32)
    prefill.wait(prefill.call("prepare", key, [19, 20], 32))
    _layers(prefill, key, 0)
    start = time.monotonic()
    out_d = decode.wait(fd, timeout_s=10)
    assert (out_d.ok, out_d.cause) == (False, "lease"), out_d
    assert time.monotonic() - start < 4  # the lease is 1.5 s
    assert_idle(prefill, decode)


def test_a_layer_write_that_fails_in_nixl_fails_the_push(tmp_path):
    """Decode registered only the lower half of its blocks with NIXL: the first piece into
    the upper half fails, decode hears it at once, and the push reports it."""
    port = free_port()
    prefill = Side("prefill", prefill_config(port), LAYERS, seed=3)
    decode = Side("decode", decode_config(), LAYERS, fault="register-half")
    try:
        address = PrefillAddress("127.0.0.1", port)
        key = new_key()
        fd = _registered(prefill, decode, address, key, [60, 61], 32)
        prefill.wait(prefill.call("prepare", key, [1, 2], 32))
        _layers(prefill, key, 0)
        out_d = decode.wait(fd, timeout_s=5)
        assert (out_d.ok, out_d.cause) == (False, "write") and "layer" in out_d.reason, out_d
        out_p = prefill.wait(prefill.call("push", key, [1, 2], 32))
        assert (out_p.ok, out_p.cause) == (False, "write"), out_p
        assert_idle(prefill, decode)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_simulated_forward_writes_its_layers_as_it_goes(quad, layerwise):
    """The benchmark's forward (harness.simulated_forward, two layers of two regions here):
    layer by layer, the first layer (and the last's first region) go out before the push;
    without, nothing does.
    Either way decode gets every byte and the first token."""
    prefill, decode, address = quad
    src, before = prefill.call("regions"), decode.call("regions")
    writes = _count(prefill, "layer_writes")
    key = new_key()
    fd = _registered(prefill, decode, address, key, [44, 45], 32)
    fid, _ = prefill.call("forward", key, [23, 24], 32, 0.01, layerwise)
    out_p, out_d = prefill.wait(fid), decode.wait(fd)
    assert out_p.ok and out_d.ok and out_d.first_token == 1, (out_p, out_d)
    written = _count(prefill, "layer_writes") - writes  # 2, or 1 if the loop lagged a layer
    assert 1 <= written <= 2 if layerwise else written == 0, written
    assert_landed(prefill, decode, src, before, [23, 24], [44, 45], 32)
    assert_idle(prefill, decode)
