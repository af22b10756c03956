"""Failure, liveness, restarts and mismatches, each with its bound. Every test starts its own
processes, since most of them kill one."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import replace

import msgspec
import numpy as np
import pytest

from kvpush.bench.harness import Side
from kvpush.transfer.wire import PrefillAddress, TransferKey
from tests.transfer.conftest import (
    COMPAT,
    SPEC,
    assert_idle,
    decode_config,
    free_port,
    prefill_config,
    spec,
    wait_for,
)
from tests.transfer.reference import expected_after_push, padded_end

pytestmark = pytest.mark.nixl  # NIXL over UCX, a process per endpoint


def new_key() -> TransferKey:
    return TransferKey(uuid.uuid4().hex)


@pytest.fixture
def sides():
    started: list[Side] = []

    def start(role, config, layout=SPEC, **kw) -> Side:
        seed = 5 + len(started) if role == "prefill" else None
        side = Side(role, config, layout, seed=seed, **kw)
        started.append(side)
        return side

    yield start
    for side in started:
        side.close()


def test_write_that_fails_in_nixl_fails_decode_at_once(sides):
    port = free_port()
    prefill = sides("prefill", prefill_config(port))
    decode = sides("decode", decode_config(), fault="register-half")
    address = PrefillAddress("127.0.0.1", port)
    key = new_key()
    fd = decode.call("expect", key, address, [60, 61], 32)  # upper half: not registered
    fp = prefill.call("push", key, [1, 2], 32)
    out_p = prefill.wait(fp, timeout_s=5)
    assert (out_p.ok, out_p.cause) == (False, "write") and "WRITE" in out_p.reason
    start = time.monotonic()
    out_d = decode.wait(fd, timeout_s=5)
    assert (out_d.ok, out_d.cause) == (False, "write"), out_d  # prefill's cause, on the wire
    assert "prefill failed the transfer" in out_d.reason
    assert time.monotonic() - start < 1.0
    assert_idle(prefill, decode)


def test_killed_prefill_fails_decode_within_6s(sides):
    port = free_port()
    prefill = sides("prefill", prefill_config(port))
    decode = sides("decode", decode_config())
    fd = decode.call("expect", new_key(), PrefillAddress("127.0.0.1", port), [1, 2], 32)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    prefill.kill()
    killed = time.monotonic()
    out = decode.wait(fd, timeout_s=10)
    assert (out.ok, out.cause) == (False, "dead") and "is dead" in out.reason, out
    assert time.monotonic() - killed < 6.0
    assert_idle(decode)


def test_killed_decode_frees_prefill_blocks_within_6s(sides):
    port = free_port()
    prefill = sides("prefill", prefill_config(port, lease_s=60.0))
    decode = sides("decode", decode_config())
    key = new_key()
    decode.call("expect", key, PrefillAddress("127.0.0.1", port), [1, 2], 32)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    decode.kill()
    killed = time.monotonic()
    out = prefill.wait(prefill.call("push", key, [3, 4], 32), timeout_s=10)
    # the WRITE fails on the wire, or the peer is declared dead first: which one is a race
    assert not out.ok and out.cause in ("dead", "write"), out
    assert re.search("is dead|REMOTE_DISCONNECT", out.reason), out.reason
    assert time.monotonic() - killed < 6.0
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 0, 1, "registration dropped")


@pytest.mark.parametrize("prepared", [False, True])
def test_killed_decode_registration_is_dropped_by_liveness(sides, prepared):
    """Also when prefill had made the WRITE to it ready (prepare): released with it."""
    port = free_port()
    prefill = sides("prefill", prefill_config(port, lease_s=60.0))
    decode = sides("decode", decode_config())
    address = PrefillAddress("127.0.0.1", port)
    # One finished transfer first, so the peers know each other; then a registration that
    # prefill holds for decode when decode dies: liveness drops it long before the lease.
    key = new_key()
    fd = decode.call("expect", key, address, [1, 2], 32)
    fp = prefill.call("push", key, [3, 4], 32)
    assert decode.wait(fd).ok and prefill.wait(fp).ok
    key = new_key()
    decode.call("expect", key, address, [1, 2], 32)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    if prepared:
        prefill.wait(prefill.call("prepare", key, [3, 4], 32))
        assert prefill.call("gauges")["prepared"] == 1
    decode.kill()
    killed = time.monotonic()
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 0, 6, "prefill drops the dead peer")
    assert time.monotonic() - killed < 6.0
    assert prefill.call("gauges")["prepared"] == 0


def test_restarted_decode_and_prefill_rehandshake(sides):
    port = free_port()
    address = PrefillAddress("127.0.0.1", port)
    prefill = sides("prefill", prefill_config(port))
    decode = sides("decode", decode_config())
    key = new_key()
    fd = decode.call("expect", key, address, [1, 2], 32)
    assert prefill.wait(prefill.call("push", key, [3, 4], 32)).ok and decode.wait(fd).ok

    decode.kill()
    decode = sides("decode", decode_config())  # same engine id and rank, new instance
    key = new_key()
    fd = decode.call("expect", key, address, [5, 6], 32)
    assert prefill.wait(prefill.call("push", key, [3, 4], 32)).ok and decode.wait(fd).ok
    wait_for(lambda: prefill.call("gauges")["peers"] == 1, 6, "stale decode peer dropped")

    prefill.kill()
    prefill = sides("prefill", prefill_config(port))  # same address, new instance
    src = prefill.call("regions")
    key = new_key()
    fd = decode.call("expect", key, address, [7, 8], 32)
    fp = prefill.call("push", key, [3, 4], 32)
    out = decode.wait(fd, timeout_s=10)
    assert out.ok, out.reason
    assert prefill.wait(fp).ok
    bb = SPEC.block_size * SPEC.num_heads * SPEC.head_bytes
    assert np.array_equal(decode.call("regions")[1][7 * bb : 9 * bb], src[1][3 * bb : 5 * bb])
    assert_idle(prefill, decode)


@pytest.mark.parametrize(
    ("field", "decode_compat", "decode_spec", "message"),
    [
        (
            "model",
            msgspec.structs.replace(COMPAT, model="other"),
            SPEC,
            "model: prefill='tiny' decode='other'",
        ),
        (
            "dtype",
            msgspec.structs.replace(COMPAT, dtype="bfloat16"),
            SPEC,
            "dtype: prefill='float16' decode=",
        ),
        ("layout", COMPAT, spec(head_major=False), "prefill=head-major"),
    ],
)
def test_handshake_refuses_a_mismatch_naming_both_values(
    sides, field, decode_compat, decode_spec, message
):
    port = free_port()
    prefill = sides("prefill", prefill_config(port))
    decode = sides("decode", replace(decode_config(), compat=decode_compat), decode_spec)
    out = decode.wait(
        decode.call("expect", new_key(), PrefillAddress("127.0.0.1", port), [1], 16), timeout_s=5
    )
    assert (out.ok, out.cause) == (False, "handshake"), out
    assert "handshake refused" in out.reason and message in out.reason, out.reason
    assert prefill.call("gauges")["peers"] == 0
    assert_idle(prefill, decode)


def test_a_wrong_prefill_engine_id_fails_each_transfer_that_names_it(sides):
    """Checked per transfer, not once per link: the third transfer reuses the link the
    second one made, naming the right engine, and must still fail at once."""
    port = free_port()
    prefill = sides("prefill", prefill_config(port))
    decode = sides("decode", decode_config())
    for named in ("other", "prefill-a", "other"):
        key = new_key()
        address = PrefillAddress("127.0.0.1", port, engine_id=named)
        fd = decode.call("expect", key, address, [1, 2], 32)
        if named == "prefill-a":
            assert prefill.wait(prefill.call("push", key, [1, 2], 32), timeout_s=5).ok
            assert decode.wait(fd, timeout_s=5).ok
            continue
        out = decode.wait(fd, timeout_s=1)  # at once, not at prefill's lease (1.5 s)
        assert (out.ok, out.cause) == (False, "handshake"), out
        assert "the router named 'other', it is 'prefill-a'" in out.reason, out.reason
    assert_idle(prefill, decode)


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 32), (32, 16), (16, 64), (64, 16)])
def test_block_size_mismatch_lands_token_exact(sides, src_bs, dst_bs):
    check_block_sizes(sides, src_bs, dst_bs)


def check_block_sizes(sides, src_bs: int, dst_bs: int, device: str = "cpu", **cfg) -> list:
    """`cfg`: more TransferConfig fields for both sides (staging, in test_staging)."""
    port = free_port()
    prefill = sides("prefill", prefill_config(port, **cfg), spec(block_size=src_bs, device=device))
    decode = sides("decode", decode_config(**cfg), spec(block_size=dst_bs, device=device))
    src_ids = list(range(3, 3 + -(-96 // src_bs)))
    dst_ids = [9, 4, 20, 21, 22, 30][: -(-96 // dst_bs)]
    key = new_key()
    src, before = prefill.call("regions"), decode.call("regions")
    fd = decode.call("expect", key, PrefillAddress("127.0.0.1", port), dst_ids, 90, 20)
    assert prefill.wait(prefill.call("push", key, src_ids, 90)).ok
    assert decode.wait(fd).ok
    want = expected_after_push(
        src, before, prefill.spec, decode.spec, src_ids, dst_ids, 20, 90, range(2)
    )
    for got, exp in zip(decode.call("regions"), want, strict=True):
        assert np.array_equal(got, exp)
    return [prefill, decode]


def _tp(rank: int, tp: int, heads: int = 4, device: str = "cpu", layers: int = 1):
    per = heads // tp
    return spec(
        num_heads=per,
        first_head=rank * per,
        total_heads=heads,
        device=device,
        num_regions=2 * layers,
    )


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layer_by_layer"])
def test_tp1_prefill_to_tp2_decode_splits_heads(sides, layered):
    tp1_to_tp2(sides, layered=layered)


def tp1_to_tp2(sides, device: str = "cpu", layered: bool = False, **cfg) -> list:
    port = free_port()
    prefill = sides(
        "prefill", prefill_config(port, **cfg), _tp(0, 1, device=device, layers=1 + layered)
    )
    decodes = [
        sides(
            "decode",
            decode_config(rank=r, tp_size=2, **cfg),
            _tp(r, 2, device=device, layers=1 + layered),
        )
        for r in range(2)
    ]
    check_tp(port, [prefill], decodes, prefill_tp=1, layered=layered)
    return [prefill, *decodes]


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layer_by_layer"])
def test_tp2_prefill_to_tp1_decode_gathers_heads(sides, layered):
    tp2_to_tp1(sides, layered=layered)


def tp2_to_tp1(sides, device: str = "cpu", layered: bool = False, **cfg) -> list:
    port = free_port(span=2)
    prefills = [
        sides(
            "prefill",
            prefill_config(port + r, rank=r, tp_size=2, **cfg),
            _tp(r, 2, device=device, layers=1 + layered),
        )
        for r in range(2)
    ]
    decode = sides("decode", decode_config(**cfg), _tp(0, 1, device=device, layers=1 + layered))
    check_tp(port, prefills, [decode], prefill_tp=2, layered=layered)
    return [*prefills, decode]


def check_tp(port, prefills, decodes, prefill_tp, layered=False):
    """Each decode rank gets exactly its heads from every prefill rank that holds them.
    `layered`: every prefill rank writes its layers to every decode rank it feeds as they
    are computed (PrefillEndpoint.computed), all but the last before the push."""
    address = PrefillAddress("127.0.0.1", port, prefill_tp)
    key = new_key()
    src = [p.call("regions") for p in prefills]
    before = [d.call("regions") for d in decodes]
    src_ids, dst_ids = [4, 5, 6], [10, 12, 14]
    fds = [d.call("expect", key, address, dst_ids, 40) for d in decodes]
    if layered:
        feeds = len(decodes) // len(prefills) or 1  # decode ranks each prefill rank writes to
        for p in prefills:
            wait_for(lambda p=p: p.call("gauges")["registrations"] == feeds, 5, "registrations")
            p.wait(p.call("prepare", key, src_ids, 40))
            writes = p.call("counters")["layer_writes"]
            for r in range(p.spec.num_regions):
                p.wait(p.call("computed", [key], [r]))
            assert p.call("counters")["layer_writes"] == writes + feeds * (p.spec.num_regions - 1)
        assert not any(d.call("done", f) for d, f in zip(decodes, fds, strict=True))
    fps = [p.call("push", key, src_ids, 40) for p in prefills]
    assert all(p.wait(f).ok for p, f in zip(prefills, fps, strict=True))
    assert all(d.wait(f).ok for d, f in zip(decodes, fds, strict=True))
    for d, d_before in zip(decodes, before, strict=True):
        want = d_before
        for p, p_src in zip(prefills, src, strict=True):
            lo = max(p.spec.first_head, d.spec.first_head)
            hi = min(p.spec.first_head + p.spec.num_heads, d.spec.first_head + d.spec.num_heads)
            if lo < hi:
                end = padded_end(p.spec, d.spec, 40)
                want = expected_after_push(
                    p_src, want, p.spec, d.spec, src_ids, dst_ids, 0, end, range(lo, hi)
                )
        for got, exp in zip(d.call("regions"), want, strict=True):
            assert np.array_equal(got, exp)
    assert_idle(*prefills, *decodes)
