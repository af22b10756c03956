from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kvpush.bench.harness import LayoutSpec, Side
from kvpush.transfer.endpoint import TransferConfig
from kvpush.transfer.router import Abandoner
from kvpush.transfer.wire import Compat, Failure, PrefillAddress, TransferKey
from tests.servers import free_port  # noqa: F401 - the transfer tests import it from here

COMPAT = Compat(mode="push", model="tiny", dtype="float16", layout_kind="test")
SPEC = LayoutSpec(num_blocks=64, block_size=16, num_heads=2, head_bytes=32)


# A short lease: ended transfers' records (kept for a lease to answer late messages) expire
# soon, so that each test's check that every gauge is back to 0 waits 1.5 s, not 3.
LEASE_S = 1.5


def prefill_config(port: int, **kw) -> TransferConfig:
    kw.setdefault("lease_s", LEASE_S)
    return TransferConfig("prefill-a", COMPAT, side_channel_port=port, **kw)


def decode_config(**kw) -> TransferConfig:
    kw.setdefault("lease_s", LEASE_S)
    return TransferConfig("decode-a", COMPAT, **kw)


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Poll until predicate() is true; return the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def assert_idle(*sides: Side, timeout_s: float = 5.0) -> None:
    """Every gauge (pending, in flight, quarantined, records) returns to 0."""

    def idle() -> bool:
        for side in sides:
            g = side.call("gauges")
            g.pop("peers", None)
            if any(g.values()):
                return False
        return True

    wait_for(idle, timeout_s, f"gauges back to 0: {[s.call('gauges') for s in sides]}")


def endpoints(layout: LayoutSpec, seed: int):
    """One prefill and one decode endpoint over `layout`, each in its own process (a
    generator for a fixture)."""
    port = free_port()
    prefill = Side("prefill", prefill_config(port), layout, seed=seed)
    decode = Side("decode", decode_config(), layout)
    yield prefill, decode, PrefillAddress("127.0.0.1", port)
    prefill.close()
    decode.close()


@pytest.fixture(scope="module")
def pair():
    yield from endpoints(SPEC, 11)


def give_up(prefill: Side, address: PrefillAddress, key: TransferKey, by: str) -> None:
    """Prefill's scheduler aborts `key` ("scheduler"), or the router ABANDONs it ("router"),
    both because the client left."""
    if by == "scheduler":
        prefill.wait(prefill.call("abort", key, Failure("aborted", "client left")))
        return
    router = Abandoner()
    try:
        router.abandon(address, key.transfer_id, "client left")
    finally:
        router.close()


def spec(**kw) -> LayoutSpec:
    return replace(SPEC, **kw)
