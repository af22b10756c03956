"""Aborts, failures and crashes, each with its bound; every block is freed afterwards.

This module starts its own pair (and kills it), with slow chunked prefill on the prefill
engine (64 tokens a step, prompts up to 32k tokens) so an abort can land mid-prefill, and a
10 s lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import replace

import aiohttp
import httpx
import pytest

from tests.e2e.client import (
    abort_after,
    body,
    decode_params,
    disagg,
    plain,
    post,
    prefill_params,
    session,
    tokens,
    wait_idle,
    wait_usage_zero,
)
from tests.e2e.conftest import as_pair, free_port, pair_specs, start

pytestmark = pytest.mark.e2e
LEASE_S = 10.0


@pytest.fixture(scope="module")
def victims(tiny_model):
    prefill, decode = pair_specs(str(tiny_model), 32, 32, lease_s=LEASE_S)
    prefill = replace(prefill, extra_args=("--max-num-batched-tokens", "64"), max_model_len=32768)
    decode = replace(decode, max_model_len=32768)
    engines = start(prefill, decode)
    victims = {"prefill": engines[0], "decode": engines[1]}
    yield victims
    # A test restarts prefill in place: stop what the dict holds now, and the originals.
    for e in {*engines, *victims.values()}:
        e.stop()


@pytest.fixture
def fpair(victims):
    return as_pair(victims["prefill"], victims["decode"])


def assert_failed_for(engine, tid: str, *causes: str, timeout_s: float = 5.0) -> None:
    """The engine logged transfer `tid` as failed for one of `causes` (wire.CAUSES): the
    test's 500 was this failure and not some other."""
    wanted = [f"transfer {tid}#0 failed ({cause})" for cause in causes]
    deadline = time.monotonic() + timeout_s
    while True:
        text = engine.log_path.read_text(errors="replace")
        if any(w in text for w in wanted):
            return
        if time.monotonic() > deadline:
            mine = [ln for ln in text.splitlines() if tid in ln]
            raise AssertionError(f"{engine.spec.name} logged none of {wanted}; its lines: {mine}")
        time.sleep(0.1)


def decode_leg(c, pair, tid, p, stream=True):
    b = body(p, 8, stream=stream, kv_transfer_params=decode_params(pair, tid))
    return post(c, pair.decode_url, b)


def prefill_leg(c, pair, tid, p):
    return post(c, pair.prefill_url, body(p, 1, kv_transfer_params=prefill_params(tid)))


def test_decode_abort_while_waiting_then_late_prefill_frees_both_within_2s(fpair):
    async def go():
        async with session() as c:
            tid, p = uuid.uuid4().hex, tokens(300, 1)
            await abort_after(decode_leg(c, fpair, tid, p), 1.0)  # registered, then gone
            wait_usage_zero(fpair.decode_url, timeout_s=2)  # prefill acknowledged the cancel
            await prefill_leg(c, fpair, tid, p)  # prefill finishes after decode left

    asyncio.run(go())
    wait_idle(fpair.prefill_url, fpair.decode_url, timeout_s=2)  # freed, not written


@pytest.mark.parametrize("after_s", [0.05, 0.2, 0.6])
def test_decode_abort_at_any_moment_frees_both_within_2s(fpair, after_s):
    """The decode leg is dropped at some moment of the push: before, during or after it."""

    async def go():
        async with session() as c:
            tid, p = uuid.uuid4().hex, tokens(1000, 2)
            legs = asyncio.gather(
                prefill_leg(c, fpair, tid, p), abort_after(decode_leg(c, fpair, tid, p), after_s)
            )
            await legs

    asyncio.run(go())
    wait_idle(fpair.prefill_url, fpair.decode_url, timeout_s=2)


def test_prefill_abort_fails_decode_within_1s(fpair, victims):
    async def go():
        async with session() as c:
            # ~310 prefill steps of 64 tokens, a few seconds: at 3,000 tokens (47 steps, about
            # 0.3 s on an idle machine) prefill could finish before the abort landed.
            tid, p = uuid.uuid4().hex, tokens(20000, 3)
            decode = asyncio.ensure_future(decode_leg(c, fpair, tid, p, stream=False))
            await asyncio.sleep(0.5)
            await abort_after(prefill_leg(c, fpair, tid, p), 0.3)
            aborted = time.monotonic()
            with pytest.raises(aiohttp.ClientResponseError) as err:
                await decode
            return tid, time.monotonic() - aborted, err.value

    tid, took, response = asyncio.run(go())
    assert response.status == 500
    assert took < 1.0, f"decode learned of the prefill abort after {took:.2f} s"
    assert_failed_for(victims["decode"], tid, "aborted")
    wait_idle(fpair.prefill_url, fpair.decode_url, timeout_s=2)


def test_decode_that_never_registers_is_freed_by_the_lease(fpair, victims):
    tid = uuid.uuid4().hex

    async def go():
        async with session() as c:
            await prefill_leg(c, fpair, tid, tokens(200, 4))
            return time.monotonic()

    done = asyncio.run(go())
    took = wait_usage_zero(fpair.prefill_url, timeout_s=LEASE_S + 3)
    assert LEASE_S - 1 < time.monotonic() - done < LEASE_S + 3, took
    assert_failed_for(victims["prefill"], tid, "lease")
    wait_idle(fpair.prefill_url, fpair.decode_url, timeout_s=2)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"do_remote_prefill": True, "remote_port": 5600}, "remote_host"),
        ({"do_remote_prefill": True, "remote_host": "x", "remote_port": "5600"}, "remote_port"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "both true"),
        ({"do_remote_decode": True, "transfer_id": 7}, "transfer_id"),
        ({"do_remote_decode": True, "pp_size": 2}, "pp_size"),
    ],
)
def test_malformed_params_get_400_naming_the_field(fpair, params, field):
    for url in (fpair.prefill_url, fpair.decode_url):
        r = httpx.post(url + "/v1/completions", json=body("hi", 4, kv_transfer_params=params))
        assert r.status_code == 400
        assert field in r.json()["error"]["message"]
    wait_idle(fpair.prefill_url, fpair.decode_url, timeout_s=2)


def test_prompt_lists_and_n_are_refused_in_push_mode(fpair):
    params = prefill_params("t")
    r = httpx.post(
        fpair.prefill_url + "/v1/completions", json=body(["a", "b"], 2, kv_transfer_params=params)
    )
    assert r.status_code == 400 and "one prompt per request" in r.text
    r = httpx.post(
        fpair.prefill_url + "/v1/completions", json=body("a", 2, n=2, kv_transfer_params=params)
    )
    assert r.status_code == 400 and "n=2" in r.text


def test_wrong_prefill_engine_id_fails_the_request_clearly(fpair, victims):
    tid = uuid.uuid4().hex

    async def go():
        async with session() as c:
            params = decode_params(fpair, tid) | {"remote_engine_id": "other"}
            b = body(tokens(100, 5), 4, kv_transfer_params=params)
            async with c.post(fpair.decode_url + "/v1/completions", json=b) as r:
                return r.status

    assert asyncio.run(go()) == 500
    assert_failed_for(victims["decode"], tid, "handshake")
    wait_idle(fpair.decode_url, timeout_s=2)


def test_killed_prefill_fails_waiting_decode_within_10s_and_decode_serves_on(victims, mono_url):
    pair = as_pair(victims["prefill"], victims["decode"])
    tid = uuid.uuid4().hex

    async def go():
        async with session() as c:
            p = tokens(200, 6)
            decode = asyncio.ensure_future(decode_leg(c, pair, tid, p, stream=False))
            await asyncio.sleep(1.0)  # registered with prefill, which never runs the leg
            victims["prefill"].kill()
            killed = time.monotonic()
            with pytest.raises(aiohttp.ClientResponseError):
                await decode
            return time.monotonic() - killed

    assert asyncio.run(go()) < 10.0
    assert_failed_for(victims["decode"], tid, "dead")
    wait_idle(pair.decode_url, timeout_s=2)
    # A new prefill engine on the same side-channel port: decode serves through it.
    spec = victims["prefill"].spec
    (victims["prefill"],) = start(replace(spec, port=free_port()))
    pair = as_pair(victims["prefill"], victims["decode"])

    async def again():
        async with session() as c:
            p = tokens(100, 7)
            want = await plain(c, mono_url, p, 8)
            return want, await disagg(c, pair, p, 8)

    want, got = asyncio.run(again())
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=2)


def test_killed_decode_frees_prefill_blocks_within_10s(victims):
    pair = as_pair(victims["prefill"], victims["decode"])
    tid = uuid.uuid4().hex

    async def go():
        async with session() as c:
            p = tokens(200, 8)
            decode = asyncio.ensure_future(decode_leg(c, pair, tid, p, stream=False))
            await asyncio.sleep(1.0)  # decode registered; prefill has not started
            victims["decode"].kill()
            killed = time.monotonic()
            with contextlib.suppress(aiohttp.ClientError):
                await decode
            await prefill_leg(c, pair, tid, p)
            return killed

    killed = asyncio.run(go())
    wait_usage_zero(pair.prefill_url, timeout_s=10)
    assert time.monotonic() - killed < 10.0
    # Prefill saw decode die (its heartbeats stop) or its WRITE fail, whichever came first.
    assert_failed_for(victims["prefill"], tid, "dead", "write")
