"""PrefillEndpoint.prepare(): the WRITE made ready while prefill computes, posted by push().

Real endpoints in their own processes with NIXL agents over UCX (conftest's `pair`).
"""

from __future__ import annotations

import time

import pytest

from tests.transfer.conftest import assert_idle, give_up, wait_for
from tests.transfer.test_push import assert_landed, new_key

pytestmark = pytest.mark.nixl  # NIXL over UCX, a process per endpoint


def _ready_ahead(prefill) -> int:
    return prefill.call("counters")["ready_ahead"]


def _registered(prefill, decode, address, key, dst_ids, num_tokens, cached=0):
    fd = decode.call("expect", key, address, dst_ids, num_tokens, cached)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    return fd


def test_a_write_made_ready_before_the_push_lands_byte_exact_with_its_first_token(pair):
    prefill, decode, address = pair
    src, before, used = prefill.call("regions"), decode.call("regions"), _ready_ahead(prefill)
    key = new_key()
    fd = _registered(prefill, decode, address, key, [30, 31, 33], 40)
    prefill.wait(prefill.call("prepare", key, [4, 5, 6], 40))
    assert prefill.call("gauges")["prepared"] == 1
    out_p = prefill.wait(prefill.call("push", key, [4, 5, 6], 40, 9))
    out_d = decode.wait(fd)
    # the notification is given at the post, not when the WRITE was made ready
    assert out_p.ok and out_d.ok and out_d.first_token == 9, (out_p, out_d)
    assert _ready_ahead(prefill) == used + 1
    assert_landed(prefill, decode, src, before, [4, 5, 6], [30, 31, 33], 40)
    assert_idle(prefill, decode)


def test_a_registration_after_prepare_is_made_ready_as_it_comes(pair):
    prefill, decode, address = pair
    src, before, used = prefill.call("regions"), decode.call("regions"), _ready_ahead(prefill)
    key = new_key()
    prefill.wait(prefill.call("prepare", key, [7, 8], 20))
    fd = _registered(prefill, decode, address, key, [40, 41], 20, cached=5)
    time.sleep(0.2)  # the registration's message is handled by the time push() comes
    out_p = prefill.wait(prefill.call("push", key, [7, 8], 20))
    assert out_p.ok and decode.wait(fd).ok
    assert _ready_ahead(prefill) == used + 1
    assert_landed(prefill, decode, src, before, [7, 8], [40, 41], 20, cached=5)
    assert_idle(prefill, decode)


def test_a_push_from_other_blocks_than_prepared_is_planned_afresh(pair):
    """A request preempted after prepare() is scheduled again into other blocks: push()
    must not post the WRITE made ready from the old ones."""
    prefill, decode, address = pair
    src, before, used = prefill.call("regions"), decode.call("regions"), _ready_ahead(prefill)
    key = new_key()
    fd = _registered(prefill, decode, address, key, [50, 51], 32)
    prefill.wait(prefill.call("prepare", key, [1, 2], 32))
    out_p = prefill.wait(prefill.call("push", key, [9, 10], 32))
    assert out_p.ok and decode.wait(fd).ok
    assert _ready_ahead(prefill) == used
    assert_landed(prefill, decode, src, before, [9, 10], [50, 51], 32)
    assert_idle(prefill, decode)


@pytest.mark.parametrize("by", ["scheduler", "router"])
def test_an_abort_after_prepare_holds_nothing(pair, by):
    """Prefill's scheduler aborts the request, or the router ABANDONs it, before the push."""
    prefill, decode, address = pair
    key = new_key()
    fd = _registered(prefill, decode, address, key, [52, 53], 32)
    prefill.wait(prefill.call("prepare", key, [1, 2], 32))
    give_up(prefill, address, key, by)
    out_d = decode.wait(fd, timeout_s=5)
    assert (out_d.ok, out_d.cause) == (False, "aborted" if by == "scheduler" else "abandoned")
    assert_idle(prefill, decode)


def test_a_prepare_whose_push_never_comes_is_dropped_after_the_lease(pair):
    prefill, decode, _ = pair
    prefill.wait(prefill.call("prepare", new_key(), [1, 2], 32))  # nobody registers either
    assert prefill.call("gauges")["prepared"] == 1
    wait_for(lambda: prefill.call("gauges")["prepared"] == 0, 5, "prepare dropped (lease 1.5 s)")
    assert_idle(prefill, decode)


def test_a_prepare_after_the_push_changes_nothing(pair):
    prefill, decode, address = pair
    src, before, used = prefill.call("regions"), decode.call("regions"), _ready_ahead(prefill)
    key = new_key()
    fd = _registered(prefill, decode, address, key, [58, 59], 32)
    out_p = prefill.wait(prefill.call("push", key, [3, 4], 32))
    prefill.wait(prefill.call("prepare", key, [3, 4], 32))  # late: the push has ended
    assert out_p.ok and decode.wait(fd).ok
    assert prefill.call("gauges")["prepared"] == 0 and _ready_ahead(prefill) == used
    assert_landed(prefill, decode, src, before, [3, 4], [58, 59], 32)
    assert_idle(prefill, decode)
