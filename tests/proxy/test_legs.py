"""The HTTP layer's legs (proxy.app): aiohttp's errors reach the dispatcher as its own
(`LegError` and its kinds), from real connections to fake engines and to a closed port."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvpush.proxy import dispatch
from kvpush.proxy.app import HttpLegs, transport_errors
from kvpush.proxy.config import EngineInfo, EngineState, ProxyConfig
from kvpush.proxy.pool import EnginePool
from tests.proxy.fake_engine import fake_engine
from tests.servers import free_port, run_server

STREAM = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (aiohttp.ServerTimeoutError("read"), dispatch.LegTimeout),
        (aiohttp.ServerDisconnectedError(), dispatch.LegBroken),
        (aiohttp.ClientOSError(104, "reset"), dispatch.LegBroken),
        (aiohttp.ClientPayloadError("truncated"), dispatch.LegError),
    ],
)
def test_aiohttp_errors_become_the_dispatchers_own(raised, expected):
    engine = EngineState(EngineInfo("http://d0", "decode", "d0"))
    with pytest.raises(dispatch.LegError) as got, transport_errors(engine):
        raise raised
    assert type(got.value) is expected and got.value.__cause__ is raised
    assert "http://d0" in str(got.value)


def test_other_errors_pass_through():
    engine = EngineState(EngineInfo("http://d0", "decode", "d0"))
    with pytest.raises(ValueError), transport_errors(engine):
        raise ValueError("not a transport error")


def legs_for(*engines: EngineInfo):
    pool = EnginePool(ProxyConfig(engines=engines, connect_timeout_s=2.0))
    return pool, HttpLegs(pool)


def test_an_engine_nobody_listens_for_is_unreachable():
    ports = free_port(), free_port()  # nothing listens there

    async def go():
        pool, legs = legs_for(
            EngineInfo(f"http://127.0.0.1:{ports[0]}", "prefill", "p0"),
            EngineInfo(f"http://127.0.0.1:{ports[1]}", "decode", "d0"),
        )
        await pool.start()
        try:
            prefill, decode = pool.states
            with pytest.raises(dispatch.EngineUnreachable):
                await legs.prefill(prefill, False, STREAM, {})
            with pytest.raises(dispatch.EngineUnreachable):
                await legs.decode(decode, False, STREAM, {})
        finally:
            await pool.stop()

    asyncio.run(go())


def test_a_stream_that_fails_mid_answer_raises_a_leg_error_from_its_reads():
    prefill, decode = fake_engine("tiny", "ok"), fake_engine("tiny", "500-mid-stream")
    with run_server(prefill) as p_url, run_server(decode) as d_url:

        async def go():
            pool, legs = legs_for(
                EngineInfo(p_url, "prefill", "p0"), EngineInfo(d_url, "decode", "d0")
            )
            await pool.start()
            try:
                response = await legs.decode(pool.states[1], False, STREAM, {})
                assert response.status == 200
                chunks = []
                with pytest.raises(dispatch.LegError):
                    async for chunk in response.content.iter_any():
                        chunks.append(chunk)
                assert b"".join(chunks).startswith(b"data: ")  # the first event came through
                response.close()
            finally:
                await pool.stop()

        asyncio.run(go())
