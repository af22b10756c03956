"""The HTTP layer's legs (proxy.app): aiohttp's errors reach the dispatcher as its own
(`LegError` and its kinds), from real connections to fake engines and to a closed port."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvpush.proxy.app import HttpLegs, transport_errors
from kvpush.proxy.config import EngineInfo, EngineState, ProxyConfig
from kvpush.proxy.legs import EngineUnreachable, LegBroken, LegError, LegTimeout
from kvpush.proxy.pool import EnginePool
from tests.proxy.fake_engine import fake_engine
from tests.servers import free_port, run_server

STREAM = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (aiohttp.ServerTimeoutError("read"), LegTimeout),
        (aiohttp.ServerDisconnectedError(), LegBroken),
        (aiohttp.ClientOSError(104, "reset"), LegBroken),
        (aiohttp.ClientPayloadError("truncated"), LegError),
    ],
)
def test_aiohttp_errors_become_the_dispatchers_own(raised, expected):
    engine = EngineState(EngineInfo("http://d0", "decode", "d0"))
    with pytest.raises(LegError) as got, transport_errors(engine):
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
            with pytest.raises(EngineUnreachable):
                await legs.prefill(prefill, False, STREAM, {})
            with pytest.raises(EngineUnreachable):
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
                with pytest.raises(LegError):
                    async for chunk in response.content.iter_any():
                        chunks.append(chunk)
                assert b"".join(chunks).startswith(b"data: ")  # the first event came through
                response.close()
            finally:
                await pool.stop()

        asyncio.run(go())


def test_a_complete_streams_connection_is_reused_for_the_next_leg():
    """After release (the answer complete, its chunked end not yet in), the end is read and
    the connection goes back to the pool: the next decode leg opens none."""
    slow_end = fake_engine("tiny", "slow-end")
    with run_server(fake_engine("tiny")) as p_url, run_server(slow_end) as d_url:

        async def go():
            pool, legs = legs_for(
                EngineInfo(p_url, "prefill", "p0"), EngineInfo(d_url, "decode", "d0")
            )
            await pool.start()
            try:
                decode = pool.states[1]
                opened = decode.connections_opened
                for _ in range(3):
                    response = await legs.decode(decode, False, STREAM, {})
                    chunks = response.content.iter_any()
                    while not (await chunks.__anext__()).endswith(b"[DONE]\n\n"):
                        pass
                    response.release()  # as the relay does at [DONE]
                    for _ in range(100):  # its end is read in the background
                        if not legs._background:
                            break
                        await asyncio.sleep(0.01)
                assert decode.connections_opened - opened <= 1  # at most the first connect
            finally:
                await legs.close()
                await pool.stop()

        asyncio.run(go())


class EndlessBody:
    """A response whose chunked end never comes (a fault no engine makes on demand)."""

    def __init__(self) -> None:
        self.status = 200
        self.content = self
        self.closed = self.released = False

    async def read(self) -> bytes:
        await asyncio.Event().wait()
        return b""

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        self.released = True


def test_a_complete_stream_whose_end_never_comes_is_closed_not_reused(monkeypatch):
    """A reused connection could carry the rest into the next request's answer."""
    from kvpush.proxy import app

    monkeypatch.setattr(app, "REUSE_WAIT_S", 0.05)
    engine = EngineState(EngineInfo("http://d0", "decode", "d0"))

    async def go():
        pool, legs = legs_for(EngineInfo("http://p0", "prefill", "p0"), engine.info)
        body = EndlessBody()
        app.HttpDecodeResponse(body, engine, legs).release()  # type: ignore[arg-type]
        for _ in range(100):
            if body.closed:
                break
            await asyncio.sleep(0.01)
        assert body.closed and not body.released

    asyncio.run(go())


def test_close_ends_the_reads_of_streams_ends_and_closes_their_responses():
    """At shutdown a complete stream's end may still be unread: `close` ends the read and
    closes the response, not leaving it to the garbage collector with its connection open."""
    from kvpush.proxy import app

    engine = EngineState(EngineInfo("http://d0", "decode", "d0"))

    async def go():
        pool, legs = legs_for(EngineInfo("http://p0", "prefill", "p0"), engine.info)
        body = EndlessBody()
        app.HttpDecodeResponse(body, engine, legs).release()  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        assert not body.closed and not body.released
        await legs.close()
        assert body.closed and not body.released and not legs._background

    asyncio.run(go())
