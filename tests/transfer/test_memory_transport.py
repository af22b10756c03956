"""The prefill and decode endpoints end to end in one process, over the in-memory transport
(tests/memory_agent.py): every push path (direct, made ready ahead, layer by layer, staged),
a failed WRITE, cancel, abort and the lease, in well under a second each.

Fast feedback for the endpoints' logic, not a stand-in for the wire: the same behaviours are
shown over NIXL and UCX, each endpoint in its own process, in test_push.py, test_prepare.py,
test_layerwise.py, test_staging.py and test_faults.py.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import numpy as np
import pytest

from kvpush.bench.harness import LayoutSpec, Memory
from kvpush.transfer.endpoint import Outcome
from kvpush.transfer.receiver import DecodeEndpoint
from kvpush.transfer.wire import Failure, PrefillAddress, TransferKey
from kvpush.transfer.writer import PrefillEndpoint
from tests.memory_agent import MemoryAgent, agent
from tests.transfer.conftest import SPEC, decode_config, free_port, prefill_config, wait_for
from tests.transfer.reference import expected_after_push, padded_end

LAYERS = replace(SPEC, num_regions=4)


class Pair:
    """A prefill and a decode endpoint over `spec`, in this process."""

    def __init__(self, spec: LayoutSpec, **config) -> None:
        # a short lease: ended transfers' records (kept to answer late messages) go soon
        config.setdefault("lease_s", 0.5)
        self.spec = spec
        port = free_port()
        self.address = PrefillAddress("127.0.0.1", port)
        self.src, self.dst = Memory(spec, 7), Memory(spec, None)
        self.prefill = PrefillEndpoint(
            prefill_config(port, **config), spec.build(self.src.addresses()), MemoryAgent
        )
        self.decode = DecodeEndpoint(
            decode_config(**config), spec.build(self.dst.addresses()), MemoryAgent
        )

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def landed(self, before, src_ids, dst_ids, num_tokens, cached=0) -> bool:
        heads = range(self.spec.first_head, self.spec.first_head + self.spec.num_heads)
        end = padded_end(self.spec, self.spec, num_tokens)
        want = expected_after_push(
            self.src.read(), before, self.spec, self.spec, src_ids, dst_ids, cached, end, heads
        )
        return all(np.array_equal(g, w) for g, w in zip(self.dst.read(), want, strict=True))

    def idle(self) -> None:
        def nothing_held() -> bool:
            gauges = {**self.prefill.gauges(), **self.decode.gauges()}
            gauges.pop("peers", None)
            return not any(gauges.values())

        wait_for(nothing_held, 5, "every gauge back to 0")


@pytest.fixture
def pair():
    p = Pair(SPEC)
    yield p
    p.close()


@pytest.fixture
def quad():
    p = Pair(LAYERS)
    yield p
    p.close()


def new_key() -> TransferKey:
    return TransferKey(uuid.uuid4().hex, 0)


def registered(p: Pair, key: TransferKey, dst_ids, num_tokens, cached=0):
    fd = p.decode.expect(key, p.address, dst_ids, num_tokens, cached)
    wait_for(lambda: p.prefill.gauges()["pending_match"] == 1, 5, "registration at prefill")
    return fd


@pytest.mark.parametrize("order", ["register", "prefill-first", "prepared"])
def test_a_push_lands_byte_exact_in_either_order_and_frees_everything(pair, order):
    before, key = pair.dst.read(), new_key()
    if order == "prefill-first":
        fp = pair.prefill.push(key, [1, 2, 5], 40, first_token=17)
        fd = pair.decode.expect(key, pair.address, [60, 61, 62], 40)
    else:
        fd = registered(pair, key, [60, 61, 62], 40)
        if order == "prepared":
            pair.prefill.prepare(key, [1, 2, 5], 40).result(5)
        fp = pair.prefill.push(key, [1, 2, 5], 40, first_token=17)
    out_d, out_p = fd.result(5), fp.result(5)
    assert out_d.ok and out_p.ok, (out_d, out_p)
    assert out_d.first_token == 17
    assert pair.landed(before, [1, 2, 5], [60, 61, 62], 40)
    assert pair.prefill.counters["ready_ahead"] == (order == "prepared")
    assert out_p.num_bytes > 0 and {"handed", "posted", "written"} <= set(out_p.marks)
    pair.idle()


def test_layers_written_before_the_push_land_byte_exact(quad):
    before, key = quad.dst.read(), new_key()
    fd = registered(quad, key, [30, 31, 33], 40)
    quad.prefill.prepare(key, [4, 5, 6], 40).result(5)
    for region in range(4):
        quad.prefill.computed([key], [region]).result(5)
    # regions 0-2 go out as they are computed; the last waits for the push's notification
    wait_for(lambda: quad.prefill.counters["layer_writes"] >= 1, 5, "a layer written")
    assert not fd.done()
    out_p = quad.prefill.push(key, [4, 5, 6], 40, first_token=3).result(5)
    out_d = fd.result(5)
    assert out_p.ok and out_d.ok and out_d.first_token == 3
    assert quad.landed(before, [4, 5, 6], [30, 31, 33], 40)
    assert quad.prefill.counters["layered"] == 1 and "layered" in out_p.marks
    quad.idle()


def test_a_staged_push_gathers_into_one_write_and_lands_byte_exact():
    p = Pair(SPEC, staging_bytes=1 << 20, staging_min_descs=1)
    try:
        before, key = p.dst.read(), new_key()
        fd = registered(p, key, [9, 3, 40], 40)
        out_p = p.prefill.push(key, [20, 2, 11], 40).result(5)
        assert out_p.ok and fd.result(5).ok
        assert out_p.num_descs == 1 and p.prefill.counters["staged"] == 1
        assert p.landed(before, [20, 2, 11], [9, 3, 40], 40)
        p.idle()
    finally:
        p.close()


def test_a_write_that_fails_fails_both_sides_at_once_and_holds_nothing(pair):
    key = new_key()
    fd = registered(pair, key, [60], 16)
    sender = agent(pair.prefill.agent.name)
    assert sender is not None
    sender.fail_writes = True
    out_p = pair.prefill.push(key, [1], 16).result(5)
    out_d = fd.result(5)
    assert not out_p.ok and out_p.cause == "write"
    assert not out_d.ok and out_d.cause == "write"
    pair.idle()


def test_cancel_and_abort_free_both_sides(pair):
    cancelled = new_key()
    fd = registered(pair, cancelled, [60], 16)
    assert pair.decode.cancel(cancelled).result(5).ok
    assert not fd.result(5).ok
    aborted = new_key()
    fd = registered(pair, aborted, [61], 16)
    pair.prefill.abort(aborted, Failure("aborted", "client left")).result(5)
    out_d: Outcome = fd.result(5)
    assert not out_d.ok and out_d.cause == "aborted", out_d
    pair.idle()


def test_the_lease_frees_a_source_nobody_registered_for():
    p = Pair(SPEC, lease_s=0.3)
    try:
        out = p.prefill.push(new_key(), [1, 2], 32).result(5)
        assert not out.ok and out.cause == "lease"
        p.idle()
    finally:
        p.close()
