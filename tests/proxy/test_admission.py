"""Admission (kvpush.proxy.pool: `EnginePool.admit`): a decode engine holds at most its room
in prompt tokens, and at most its max_num_seqs in requests, for requests in flight; a request
beyond waits for room, then gets 503 with Retry-After. With in-memory legs; the real engines'
room, from their /metrics and /kvpush/limits, is checked in tests/e2e/test_paths.py."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.proxy.errors import ProxyError
from kvpush.proxy.relay import relay
from kvpush.proxy.timeline import Trace
from tests.proxy.test_dispatch import idle, make, until

PROMPT = {"model": "tiny", "prompt": list(range(80)), "max_tokens": 4, "stream": True}


async def finish(legs, i: int, task) -> None:
    legs.prefills[i].set_result(b'{"choices": [{"text": "x"}]}')
    legs.decodes[i].answer(b"data: 1\n\n", b"data: [DONE]\n\n")
    await relay(await task, lambda: asyncio.sleep(0), lambda b: asyncio.sleep(0))


async def one_in_flight(wait_s: float, room_tokens: int | None = 100, max_num_seqs=None):
    """A dispatcher whose decode engine has room for `room_tokens` prompt tokens and runs
    `max_num_seqs` requests at once (as its /kvpush/limits would say), and one request of 80
    tokens in flight."""
    dispatcher, pool, legs, _ = make(
        num_prefill=1, connector="kvpush", disaggregation="always",
        max_decode_prompt_tokens=room_tokens, admission_wait_s=wait_s,
    )  # fmt: skip
    pool.states[-1].max_num_seqs = max_num_seqs
    first = asyncio.ensure_future(dispatcher.dispatch(PROMPT, False, {}, Trace(None)))
    await until(lambda: legs.decode_calls)
    return dispatcher, pool, legs, first


def test_a_request_beyond_the_room_waits_until_one_ends():
    async def go():
        dispatcher, pool, legs, first = await one_in_flight(wait_s=5)
        second = asyncio.ensure_future(dispatcher.dispatch(PROMPT, False, {}, Trace(None)))
        await asyncio.sleep(0.05)
        assert len(legs.decode_calls) == 1 and not second.done()  # 80 + 80 > 100: it waits
        await finish(legs, 0, first)
        await until(lambda: len(legs.decode_calls) == 2)
        await finish(legs, 1, second)
        assert idle(pool)

    asyncio.run(go())


def test_a_request_that_finds_no_room_in_time_gets_503_with_retry_after():
    async def go():
        dispatcher, pool, legs, first = await one_in_flight(wait_s=0.1)
        with pytest.raises(ProxyError) as refused:
            await dispatcher.dispatch(PROMPT, False, {}, Trace(None))
        assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
        assert "no decode engine has room for one more request of 80" in refused.value.message
        await finish(legs, 0, first)
        assert idle(pool)

    asyncio.run(go())


def test_the_room_is_90_percent_of_the_engines_kv_cache_unless_configured():
    dispatcher, pool, _, _ = make(num_prefill=1, connector="kvpush")
    decode = pool.states[-1]
    assert pool.room(decode) is None  # capacity unknown: no bound
    decode.kv_capacity_tokens = 1000
    assert pool.room(decode) == 900
    _, configured, _, _ = make(num_prefill=1, connector="kvpush", max_decode_prompt_tokens=50)
    configured.states[-1].kv_capacity_tokens = 1000
    assert configured.room(configured.states[-1]) == 50


def test_a_decode_engine_takes_no_more_requests_than_it_runs_at_once():
    """Beyond max_num_seqs a request would wait in vLLM's queue, its push's KV held on prefill
    until decode takes it: it waits at the proxy instead, and gets 503 if none ends in time."""

    async def go():
        dispatcher, pool, legs, first = await one_in_flight(0.1, None, max_num_seqs=1)
        decode = pool.states[-1]
        with pytest.raises(ProxyError) as refused:
            await dispatcher.dispatch(PROMPT, False, {}, Trace(None))
        assert refused.value.status == 503 and "1 of 1 requests" in refused.value.message
        decode.max_num_seqs = 2
        second = asyncio.ensure_future(dispatcher.dispatch(PROMPT, False, {}, Trace(None)))
        await until(lambda: len(legs.decode_calls) == 2)
        await finish(legs, 0, first)
        await finish(legs, 1, second)
        assert idle(pool)

    asyncio.run(go())


def test_the_request_bound_is_the_engines_max_num_seqs_unless_configured():
    _, pool, _, _ = make(num_prefill=1, connector="kvpush")
    decode = pool.states[-1]
    assert pool.request_room(decode) is None  # not said yet: no bound
    decode.max_num_seqs = 0  # a plain vLLM engine: /kvpush/limits is not there
    assert pool.request_room(decode) is None
    decode.max_num_seqs = 128
    assert pool.request_room(decode) == 128
    _, configured, _, _ = make(num_prefill=1, connector="kvpush", max_decode_requests=3)
    configured.states[-1].max_num_seqs = 128
    assert configured.request_room(configured.states[-1]) == 3


def test_with_every_prefill_engine_at_its_bound_decode_computes_the_prompt():
    """A prefill engine takes at most its max_num_seqs requests too: past it, the prompt is
    computed on the decode engine the request was admitted to, not queued behind prefill."""

    async def go():
        dispatcher, pool, legs, first = await one_in_flight(5, None)
        prefill, decode = pool.states
        prefill.max_num_seqs = 1  # the first request's prefill leg holds it
        second = asyncio.ensure_future(dispatcher.dispatch(PROMPT, False, {}, Trace(None)))
        await until(lambda: len(legs.decode_calls) == 2)
        assert len(legs.prefill_calls) == 1  # no second prefill leg
        params = legs.decode_calls[1][1].get("kv_transfer_params")
        assert not params  # the whole request, on decode
        rerouted = dispatcher.metrics.registry.get_sample_value(
            "kvpush_proxy_rerouted_total", {"to": "decode"}
        )
        assert rerouted == 1
        legs.decodes[1].answer(b"data: 1\n\n", b"data: [DONE]\n\n")
        await relay(await second, lambda: asyncio.sleep(0), lambda b: asyncio.sleep(0))
        await finish(legs, 0, first)
        assert idle(pool)

    asyncio.run(go())


def test_a_prefill_engine_has_no_token_bound_and_its_request_bound_is_its_own():
    _, pool, _, _ = make(num_prefill=1, connector="kvpush", max_decode_requests=3)
    prefill = pool.states[0]
    prefill.kv_capacity_tokens, prefill.max_num_seqs = 1000, 64
    assert pool.room(prefill) is None and pool.request_room(prefill) == 64
    _, configured, _, _ = make(num_prefill=1, connector="kvpush", max_prefill_requests=2)
    assert configured.request_room(configured.states[0]) == 2
