"""The push engine over real NIXL/UCX on DRAM, prefill and decode in separate processes."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from kvpush.transfer.endpoint import TransferConfig
from kvpush.transfer.router import Abandoner, SourceAnnouncer
from kvpush.transfer.wire import PrefillAddress, TransferKey
from tests.transfer.conftest import (
    COMPAT,
    SPEC,
    assert_idle,
    free_port,
    wait_for,
)
from tests.transfer.reference import expected_after_push, padded_end

pytestmark = pytest.mark.nixl  # NIXL over UCX, a process per endpoint


def new_key(sub: int = 0) -> TransferKey:
    return TransferKey(uuid.uuid4().hex, sub)


def push(prefill, decode, address, src_ids, dst_ids, num_tokens, cached=0, order="register"):
    """Run one transfer and check every byte of decode's memory afterwards. `order`:
    "register" (decode registers first), "prefill-first", or "prepared" (decode registers,
    then prefill makes the WRITE ready (prepare) before its push posts it)."""
    src = prefill.call("regions")
    before = decode.call("regions")
    key = new_key()
    if order in ("register", "prepared"):
        fd = decode.call("expect", key, address, dst_ids, num_tokens, cached)
        time.sleep(0.3)
        if order == "prepared":
            ready = prefill.call("counters")["ready_ahead"]
            prefill.wait(prefill.call("prepare", key, src_ids, num_tokens))
        fp = prefill.call("push", key, src_ids, num_tokens)
    else:
        fp = prefill.call("push", key, src_ids, num_tokens)
        time.sleep(0.3)
        fd = decode.call("expect", key, address, dst_ids, num_tokens, cached)
    out_d, out_p = decode.wait(fd), prefill.wait(fp)
    assert out_d.ok, out_d.reason
    assert out_p.ok, out_p.reason
    if order == "prepared":
        assert prefill.call("counters")["ready_ahead"] == ready + 1
    # the timeline's marks, on one host's clock; REGISTER is sent before prefill can post
    p, d = out_p.marks, out_d.marks
    assert p["handed"] <= p["posted"] <= p["written"], p
    assert d["expected"] <= d["registered"] <= p["posted"] and d["registered"] <= d["notified"]
    # prefill announced its WRITE (POSTED) after posting it; decode heard it by then or later
    # (the notification may overtake it: then the transfer had ended and nothing is marked)
    assert "announced" not in d or p["posted"] <= d["announced"], (p, d)
    assert_landed(prefill, decode, src, before, src_ids, dst_ids, num_tokens, cached)
    return out_p


def assert_landed(prefill, decode, src, before, src_ids, dst_ids, num_tokens, cached=0):
    """Decode's memory is `before` with exactly the reference's bytes written into it."""
    heads = range(decode.spec.first_head, decode.spec.first_head + decode.spec.num_heads)
    end = padded_end(prefill.spec, decode.spec, num_tokens)
    want = expected_after_push(
        src, before, prefill.spec, decode.spec, src_ids, dst_ids, cached, end, heads
    )
    for got, exp in zip(decode.call("regions"), want, strict=True):
        assert np.array_equal(got, exp), "decode memory differs from the reference"


def test_prefill_announces_each_write_it_posts(pair):
    prefill, decode, address = pair
    before = decode.call("counters")["announcements"]
    push(prefill, decode, address, [1, 2], [60, 61], 32)
    # POSTED is only a hint to poll closely (the notification may come first), but it is
    # always sent, once per WRITE
    wait_for(lambda: decode.call("counters")["announcements"] == before + 1, 5, "one POSTED")
    assert_idle(prefill, decode)


@pytest.mark.parametrize("order", ["register", "prefill-first", "prepared"])
def test_both_arrival_orders_land_byte_exact(pair, order):
    prefill, decode, address = pair
    out = push(prefill, decode, address, [1, 2, 3, 4], [10, 11, 12, 13], 64, order=order)
    assert out.num_descs == SPEC.num_regions  # one contiguous run
    assert out.num_bytes == 64 * SPEC.num_heads * SPEC.head_bytes * SPEC.num_regions
    assert_idle(prefill, decode)


def test_fragmented_blocks_post_one_descriptor_per_run(pair):
    prefill, decode, address = pair
    out = push(prefill, decode, address, [5, 6, 7, 8, 9], [20, 21, 30, 40, 41], 80)
    assert out.num_descs == 3 * SPEC.num_regions
    assert_idle(prefill, decode)


@pytest.mark.parametrize("cached", [16, 24])
def test_cached_prefix_is_not_written_even_mid_block(pair, cached):
    prefill, decode, address = pair
    decode.call("reset")
    out = push(prefill, decode, address, [0, 1, 2, 3], [50, 51, 52, 53], 60, cached=cached)
    # the partial last block goes whole: 64 tokens' slots
    assert out.num_bytes == (64 - cached) * SPEC.num_heads * SPEC.head_bytes * SPEC.num_regions
    assert_idle(prefill, decode)


def test_sub_requests_of_one_transfer_id_pair_separately(pair):
    prefill, decode, address = pair
    decode.call("reset")
    tid = uuid.uuid4().hex
    src = prefill.call("regions")
    dst_ids = {0: [1, 2], 1: [3, 4], 2: [5, 6]}
    src_ids = {0: [10, 11], 1: [20, 21], 2: [30, 31]}
    fds = [decode.call("expect", TransferKey(tid, i), address, dst_ids[i], 32) for i in range(3)]
    fps = [prefill.call("push", TransferKey(tid, i), src_ids[i], 32) for i in (2, 0, 1)]
    assert all(decode.wait(f).ok for f in fds)
    assert all(prefill.wait(f).ok for f in fps)
    got = decode.call("regions")
    bb = SPEC.block_size * SPEC.num_heads * SPEC.head_bytes
    for i in range(3):
        for d, s in zip(dst_ids[i], src_ids[i], strict=True):
            assert np.array_equal(got[0][d * bb : (d + 1) * bb], src[0][s * bb : (s + 1) * bb])
    assert_idle(prefill, decode)


def test_late_registration_for_a_finished_key_is_answered_at_once(pair):
    prefill, decode, address = pair
    key = new_key()
    fd = decode.call("expect", key, address, [1, 2], 32)
    fp = prefill.call("push", key, [3, 4], 32)
    assert decode.wait(fd).ok and prefill.wait(fp).ok
    start = time.monotonic()
    late = decode.wait(decode.call("expect", key, address, [1, 2], 32), timeout_s=5)
    assert (late.ok, late.cause) == (False, "refused") and "already ended" in late.reason
    assert time.monotonic() - start < 1.0


def test_late_registration_for_a_failed_key_is_answered_at_once(pair):
    prefill, decode, address = pair
    key = new_key()
    out = prefill.wait(prefill.call("push", key, [3, 4], 32), timeout_s=10)
    assert (out.ok, out.cause) == (False, "lease"), out  # nobody registered within the lease
    start = time.monotonic()
    late = decode.wait(decode.call("expect", key, address, [1, 2], 32), timeout_s=5)
    assert (late.ok, late.cause) == (False, "lease") and "lease expired" in late.reason
    assert time.monotonic() - start < 1.0


def test_lease_frees_a_source_nobody_registered_for(pair):
    prefill, decode, address = pair
    start = time.monotonic()
    out = prefill.wait(prefill.call("push", new_key(), [3, 4], 32), timeout_s=10)
    elapsed = time.monotonic() - start
    assert (out.ok, out.cause) == (False, "lease") and "decode never registered" in out.reason
    assert 1.4 < elapsed < 2.5  # lease_s = 1.5
    assert_idle(prefill, decode)


def test_router_abandon_frees_a_finished_source_at_once(pair):
    """A client left before its decode leg reached decode's engine: nobody registers, and the
    router's ABANDON frees prefill's blocks now instead of at the lease (1.5 s here)."""
    prefill, decode, address = pair
    key = new_key()
    fp = prefill.call("push", key, [3, 4], 32)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "source at prefill")
    router = Abandoner()
    try:
        start = time.monotonic()
        router.abandon(address, key.transfer_id, "client left")
        out = prefill.wait(fp, timeout_s=5)
    finally:
        router.close()
    assert (out.ok, out.cause) == (False, "abandoned"), out
    assert "abandoned by the router: client left" in out.reason
    assert time.monotonic() - start < 1.0
    assert_idle(prefill, decode)


def test_router_abandon_before_prefill_finishes_fails_decode_and_frees_the_late_source(pair):
    prefill, decode, address = pair
    key = new_key()
    fd = decode.call("expect", key, address, [1, 2], 32)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    router = Abandoner()
    try:
        router.abandon(address, key.transfer_id, "client left")
        out_d = decode.wait(fd, timeout_s=5)
    finally:
        router.close()
    assert (out_d.ok, out_d.cause) == (False, "abandoned") and "abandoned" in out_d.reason
    start = time.monotonic()
    out_p = prefill.wait(prefill.call("push", key, [3, 4], 32), timeout_s=5)
    assert (out_p.ok, out_p.cause) == (False, "abandoned") and "already ended" in out_p.reason
    assert time.monotonic() - start < 1.0
    assert_idle(prefill, decode)


def test_the_schedulers_source_starts_the_push_before_push_and_push_claims_it(pair):
    prefill, decode, address = pair
    src = prefill.call("regions")
    before = decode.call("regions")
    key = new_key()
    fd = decode.call("expect", key, address, [20, 21, 22], 40)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    announcer = SourceAnnouncer()
    try:
        announcer.announce(address, key, [4, 5, 6], 40, 7)
        out_d = decode.wait(fd, timeout_s=5)  # written before the worker's push() came
    finally:
        announcer.close()
    assert out_d.ok and out_d.first_token == 7, out_d
    assert prefill.call("gauges")["unclaimed_sources"] == 1
    out_p = prefill.wait(prefill.call("push", key, [4, 5, 6], 40, 7), timeout_s=5)
    assert out_p.ok and out_p.num_bytes > 0, out_p  # the same push, not a second one
    assert_landed(prefill, decode, src, before, [4, 5, 6], [20, 21, 22], 40)
    assert_idle(prefill, decode)


def test_a_source_after_push_is_ignored(pair):
    prefill, decode, address = pair
    late = new_key()
    fd = decode.call("expect", late, address, [42, 43], 32)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    out_p = prefill.wait(prefill.call("push", late, [1, 2], 32), timeout_s=5)
    assert out_p.ok and decode.wait(fd).ok
    marker = new_key()
    fm = decode.call("expect", marker, address, [44, 45], 32)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    announcer = SourceAnnouncer()
    try:
        announcer.announce(address, late, [1, 2], 32, -1)  # after its push ended: ignored
        announcer.announce(address, marker, [1, 2], 32, -1)  # same socket: handled after it
        assert decode.wait(fm, timeout_s=5).ok
    finally:
        announcer.close()
    # only the marker's source waits for its push(): the late one started nothing
    assert prefill.call("gauges")["unclaimed_sources"] == 1
    assert prefill.wait(prefill.call("push", marker, [1, 2], 32), timeout_s=5).ok
    assert_idle(prefill, decode)


@pytest.mark.parametrize("prepared", [False, True])
def test_cancel_then_late_write_lands_nothing(pair, prepared):
    """Also when prefill had made the WRITE ready (prepare): it is released, not posted."""
    prefill, decode, address = pair
    decode.call("reset")
    key = new_key()
    fd = decode.call("expect", key, address, [7, 8], 32)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    if prepared:
        prefill.wait(prefill.call("prepare", key, [1, 2], 32))
    released = decode.wait(decode.call("cancel", key), timeout_s=5)
    assert released.ok
    assert not decode.wait(fd).ok
    out = prefill.wait(prefill.call("push", key, [1, 2], 32))
    assert not out.ok and "cancelled" in out.reason
    assert all((r == 0xEE).all() for r in decode.call("regions")), "a cancelled block was written"
    assert_idle(prefill, decode)


def test_unknown_prefill_rank_fails_by_liveness_not_lease(pair):
    _, decode, _ = pair
    nobody = PrefillAddress("127.0.0.1", free_port())
    start = time.monotonic()
    out = decode.wait(decode.call("expect", new_key(), nobody, [1], 16), timeout_s=10)
    assert not out.ok and "dead" in out.reason
    assert time.monotonic() - start < 6.5


def test_idle_endpoints_use_no_cpu(pair):
    prefill, decode, _ = pair
    assert_idle(prefill, decode)
    ticks = [_cpu_ticks(s.proc.pid) for s in (prefill, decode)]
    time.sleep(5)
    hz = 100  # USER_HZ on Linux
    for side, before in zip((prefill, decode), ticks, strict=True):
        used = (_cpu_ticks(side.proc.pid) - before) / hz / 5
        assert used < 0.02, f"idle {side.role} used {used:.1%} of a core"


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"fast_poll_s": 0.001}, "fast_poll_s must be in"),
        ({"fast_poll_s": -1e-4}, "fast_poll_s must be in"),
        ({"fast_window_s": -1.0}, "fast_window_s must be >= 0"),
    ],
)
def test_transfer_config_refuses_a_fast_poll_outside_the_busy_step(kw, message):
    with pytest.raises(ValueError, match=message):
        TransferConfig("prefill-a", COMPAT, **kw)
