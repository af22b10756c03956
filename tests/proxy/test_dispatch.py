"""The dispatcher without HTTP: in-memory legs that the test controls step by step."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.proxy.config import EngineInfo, ProxyConfig
from kvpush.proxy.dispatch import Dispatcher
from kvpush.proxy.errors import ProxyError
from kvpush.proxy.legs import EngineUnreachable, LegBroken, LegError, LegTimeout, PrefillLost
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.pool import EnginePool
from kvpush.proxy.relay import relay
from kvpush.proxy.timeline import PHASES, Trace


class FakeContent:
    def __init__(self, chunks: asyncio.Queue) -> None:
        self.chunks = chunks

    async def iter_any(self):
        while (chunk := await self.chunks.get()) is not None:
            if isinstance(chunk, Exception):  # the connection failed here
                raise chunk
            yield chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_any()])


class FakeDecodeResponse:
    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.chunks: asyncio.Queue = asyncio.Queue()  # the test puts chunks, then None
        self.content = FakeContent(self.chunks)
        self.closed = self.released = False

    async def read(self) -> bytes:
        return await self.content.read()

    def answer(self, *chunks: bytes) -> None:
        for chunk in (*chunks, None):
            self.chunks.put_nowait(chunk)

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        self.released = True


class FakeLegs:
    """Each leg waits on a future the test resolves: `prefills[i]`, `decodes[i]`."""

    def __init__(self) -> None:
        self.prefill_calls: list[tuple[str, dict]] = []
        self.decode_calls: list[tuple[str, dict]] = []
        self.order: list[str] = []  # which leg was sent when
        self.prefills: list[asyncio.Future] = []
        self.decodes: list[FakeDecodeResponse] = []
        self.arrived = asyncio.Event()

    async def prefill(self, engine, chat, body, headers):
        self.prefill_calls.append((engine.info.engine_id, body))
        self.order.append("prefill")
        future = asyncio.get_running_loop().create_future()
        self.prefills.append(future)
        self.arrived.set()
        return await future

    async def decode(self, engine, chat, body, headers):
        self.decode_calls.append((engine.info.engine_id, body))
        self.order.append("decode")
        response = FakeDecodeResponse()
        self.decodes.append(response)
        self.arrived.set()
        return response


class FakeAbandoner:
    def __init__(self) -> None:
        self.abandoned: list[str] = []

    def abandon(self, address, transfer_id, reason) -> None:
        self.abandoned.append(transfer_id)


def make(num_prefill: int = 2, connector: str = "nixl-push", forces_first_token=True, **settings):
    engines = tuple(EngineInfo(f"http://p{i}", "prefill", f"p{i}") for i in range(num_prefill))
    engines += (EngineInfo("http://d0", "decode", "d0", forces_first_token=forces_first_token),)
    # the push path unless a test says otherwise (auto starts as plain replicas)
    settings.setdefault("disaggregation", "always")
    config = ProxyConfig(engines=engines, connector=connector, **settings)
    pool, legs, abandoner = EnginePool(config), FakeLegs(), FakeAbandoner()
    return Dispatcher(config, pool, legs, ProxyMetrics(), abandoner), pool, legs, abandoner


async def until(condition) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def idle(pool: EnginePool) -> bool:
    return all(s.outstanding == 0 and s.waiting_on_prefill == 0 for s in pool.states)


STREAM = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}


def test_push_sends_the_prefill_leg_first():
    """Prefill's leg is on the TTFT; decode's only has to register before prefill ends."""

    async def go():
        dispatcher, pool, legs, _ = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefill_calls and legs.decode_calls)
        assert legs.order == ["prefill", "decode"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())


def test_a_client_gone_while_the_prefill_leg_goes_out_first_abandons_both_legs():
    """Cancelled in the yield that lets prefill's leg out first: nothing held anywhere."""

    async def go():
        dispatcher, pool, legs, abandoner = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await asyncio.sleep(0)  # the dispatch runs up to that yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await until(lambda: legs.prefills and legs.prefills[0].cancelled())
        assert legs.decode_calls == [] and len(abandoner.abandoned) == 1
        assert idle(pool)

    asyncio.run(go())


def test_push_sends_both_legs_before_prefill_answers_and_relays_decode():
    async def go():
        dispatcher, pool, legs, abandoner = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefill_calls and legs.decode_calls)
        (_, p_body), (_, d_body) = legs.prefill_calls[0], legs.decode_calls[0]
        tid = p_body["kv_transfer_params"]["transfer_id"]
        assert d_body["kv_transfer_params"]["transfer_id"] == tid
        assert p_body["max_tokens"] == 1 and not p_body["stream"]
        decode = legs.decodes[0]
        decode.chunks.put_nowait(b"data: 1\n\n")
        answer = await task
        assert answer.first == b"data: 1\n\n" and not legs.prefills[0].done()
        legs.prefills[0].set_result(b"{}")
        decode.answer(b"data: 2\n\n", b"data: [DONE]\n\n")
        out: list[bytes] = []

        async def write(b: bytes) -> None:
            out.append(b)

        await relay(answer, lambda: asyncio.sleep(0), write)
        assert out == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
        await until(lambda: decode.released)  # once its stream has ended: reused
        assert not decode.closed and abandoner.abandoned == []
        await until(lambda: idle(pool))
        phases = answer.trace.phases()
        assert set(phases) == set(PHASES)  # every phase of the timeline
        assert answer.trace.tpot_s is not None and answer.trace.status == "ok"

    asyncio.run(go())


def test_prefill_lost_before_the_first_byte_is_re_sent_to_the_other_prefill():
    async def go():
        dispatcher, pool, legs, abandoner = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: len(legs.decodes) == 1 and len(legs.prefills) == 1)
        legs.prefills[0].set_exception(PrefillLost("connection reset"))
        await until(lambda: len(legs.decodes) == 2 and len(legs.prefills) == 2)
        first, second = legs.decode_calls
        old, new = (b["kv_transfer_params"]["transfer_id"] for _, b in (first, second))
        assert old != new and legs.decodes[0].closed  # vLLM aborts it; decode cancels
        assert abandoner.abandoned == [old]
        assert [c[0] for c in legs.prefill_calls] == ["p0", "p1"]
        assert second[1]["kv_transfer_params"]["remote_engine_id"] == "p1"
        legs.prefills[1].set_result(b"{}")
        legs.decodes[1].chunks.put_nowait(b"data: x\n\n")
        answer = await task
        assert answer.trace.reroutes == ["prefill"]
        answer.finish(True)
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_with_no_prefill_left_decode_computes_the_prompt_itself():
    async def go():
        dispatcher, pool, legs, abandoner = make(num_prefill=1)
        body = STREAM | {"stream": False}
        task = asyncio.ensure_future(dispatcher.dispatch(body, False, {}, Trace(None)))
        await until(lambda: len(legs.prefills) == 1)
        legs.prefills[0].set_exception(PrefillLost("refused"))
        await until(lambda: len(legs.decodes) == 2)
        legs.decodes[1].answer(b'{"choices": []}')
        answer = await task
        assert answer.body == b'{"choices": []}'
        (_, pushed), (_, plain) = legs.decode_calls
        assert "kv_transfer_params" in pushed and "kv_transfer_params" not in plain
        assert plain == body and answer.trace.reroutes == ["prefill", "decode"]
        await until(lambda: idle(pool))

    asyncio.run(go())


@pytest.mark.parametrize("accepted", [False, True], ids=["before-decode-accepted", "after"])
def test_a_4xx_from_prefill_is_not_re_sent(accepted):
    """Raised with both legs closed. After decode accepted the request the stream has
    started: the caller turns the ProxyError into an error event."""

    async def go():
        dispatcher, pool, legs, abandoner = make()
        accepts: list[bool] = []

        async def accept() -> None:
            accepts.append(True)

        call = dispatcher.dispatch(STREAM, False, {}, Trace(None), accept if accepted else None)
        task = asyncio.ensure_future(call)
        await until(lambda: len(legs.prefills) == 1 and (accepts if accepted else legs.decodes))
        legs.prefills[0].set_exception(ProxyError(400, "prompt too long"))
        with pytest.raises(ProxyError) as err:
            await task
        assert err.value.status == 400 and len(legs.prefill_calls) == 1
        assert legs.decodes[0].closed and len(abandoner.abandoned) == 1
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_a_client_that_leaves_closes_both_legs_and_abandons():
    async def go():
        dispatcher, pool, legs, abandoner = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefills and legs.decodes)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert legs.decodes[0].closed and legs.prefills[0].cancelled()
        assert len(abandoner.abandoned) == 1
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_a_client_that_leaves_mid_stream_closes_decode_and_abandons():
    async def go():
        dispatcher, pool, legs, abandoner = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefills and legs.decodes)
        legs.decodes[0].chunks.put_nowait(b"data: 1\n\n")
        answer = await task

        async def write(b: bytes) -> None:
            raise ConnectionResetError("client gone")

        with pytest.raises(ConnectionResetError):
            await relay(answer, lambda: asyncio.sleep(0), write)
        assert legs.decodes[0].closed and len(abandoner.abandoned) == 1
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_pull_waits_for_prefill_and_passes_its_params_to_decode():
    async def go():
        dispatcher, pool, legs, abandoner = make(connector="nixl-pull")
        body = STREAM | {"stream": False}
        task = asyncio.ensure_future(dispatcher.dispatch(body, False, {}, Trace(None)))
        await until(lambda: legs.prefills)
        assert legs.decode_calls == []
        legs.prefills[0].set_result(b'{"kv_transfer_params": {"remote_block_ids": [1]}}')
        await until(lambda: legs.decodes)
        legs.decodes[0].answer(b"{}")
        assert (await task).body == b"{}"
        assert legs.decode_calls[0][1]["kv_transfer_params"] == {"remote_block_ids": [1]}
        assert abandoner.abandoned == []
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_the_timeline_is_ordered_and_its_phases_add_up_to_the_total():
    async def go():
        dispatcher, pool, legs, abandoner = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefills and legs.decodes)
        await asyncio.sleep(0.01)
        legs.prefills[0].set_result(b"{}")
        await asyncio.sleep(0.01)
        legs.decodes[0].chunks.put_nowait(b"data: 1\n\n")
        answer = await task
        legs.decodes[0].answer(b"data: [DONE]\n\n")

        async def write(b: bytes) -> None:
            await asyncio.sleep(0.005)

        await relay(answer, lambda: asyncio.sleep(0), write)
        return answer.trace

    trace = asyncio.run(go())
    at = trace.at
    order = ["arrival", "legs_sent", "decode_headers", "prefill_answer", "first_chunk"]
    assert [at[e] for e in order] == sorted(at[e] for e in order)
    assert at["first_chunk"] <= at["last_chunk"]
    p = trace.phases()
    assert p["push_tail"] >= 0.009 and p["prefill"] >= 0.009 and p["stream"] >= 0.009
    parts = p["route"] + p["prefill"] + p["push_tail"] + p["stream"]
    assert parts == pytest.approx(p["total"], abs=1e-9)


def test_a_failed_request_still_records_what_it_passed_through():
    async def go():
        dispatcher, pool, legs, abandoner = make()
        trace = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, trace))
        await until(lambda: legs.prefills and legs.decodes)
        legs.prefills[0].set_exception(ProxyError(400, "bad"))
        with pytest.raises(ProxyError):
            await task
        return trace, dispatcher.metrics

    trace, metrics = asyncio.run(go())
    assert trace.observed and trace.status == "failed: ProxyError"
    assert "legs_sent" in trace.at and "first_chunk" not in trace.at
    assert set(trace.phases()) == {"route", "decode_headers"}  # the fake answers headers at once
    route = metrics.registry.get_sample_value(
        "kvpush_proxy_phase_seconds_count", {"phase": "route"}
    )
    assert route == 1


PREFILL_ANSWER = (
    b'{"id":"cmpl-x","object":"text_completion","created":7,"model":"tiny","choices":[{"index":0,'
    b'"text":"A","logprobs":null,"finish_reason":"%s","stop_reason":null,"token_ids":null}],'
    b'"usage":{"prompt_tokens":2,"total_tokens":3,"completion_tokens":1}}'
)


def decode_chunk(text: str) -> bytes:
    return (
        b'data: {"id":"cmpl-x","object":"text_completion","created":7,"model":"tiny","choices":'
        b'[{"index":0,"text":"%s","logprobs":null,"finish_reason":null}]}\n\n' % text.encode()
    )


def test_kvpush_streams_prefills_token_first_then_decode_without_it():
    async def go():
        dispatcher, pool, legs, abandoner = make(connector="kvpush")
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefills and legs.decodes)
        await asyncio.sleep(0.01)
        assert not task.done()  # waits for prefill's answer, not decode's first chunk
        legs.prefills[0].set_result(PREFILL_ANSWER % b"length")
        answer = await task
        assert b'"text":"A"' in answer.first and "first_token" in answer.trace.at
        legs.decodes[0].answer(decode_chunk("A") + decode_chunk("B"), b"data: [DONE]\n\n")
        out: list[bytes] = []

        async def write(b: bytes) -> None:
            out.append(b)

        await relay(answer, lambda: asyncio.sleep(0), write)
        text = b"".join(out)
        assert text.count(b'"text":"A"') == 1 and b'"text":"B"' in text
        assert text.endswith(b"data: [DONE]\n\n")
        await until(lambda: legs.decodes[0].released)
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_kvpush_answer_ended_by_prefills_token_closes_decode_and_abandons():
    async def go():
        dispatcher, pool, legs, abandoner = make(connector="kvpush")
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefills and legs.decodes)
        legs.prefills[0].set_result(PREFILL_ANSWER % b"stop")
        answer = await task
        out: list[bytes] = []

        async def write(b: bytes) -> None:
            out.append(b)

        await relay(answer, lambda: asyncio.sleep(0), write)
        assert b'"finish_reason":"stop"' in out[0] and out[0].endswith(b"data: [DONE]\n\n")
        assert legs.decodes[0].closed and len(abandoner.abandoned) == 1
        assert answer.trace.status == "ok"
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_kvpush_decode_failure_after_prefills_token_ends_the_stream_with_an_error():
    """With migration off (tests/proxy/test_migrate.py has it on): the stream is relayed as
    bytes, and a failure ends it with an error event."""

    async def go():
        dispatcher, pool, legs, abandoner = make(connector="kvpush", max_migrations=0)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefills and legs.decodes)
        legs.prefills[0].set_result(PREFILL_ANSWER % b"length")
        answer = await task
        legs.decodes[0].answer(decode_chunk("A"), LegBroken("reset"))
        out: list[bytes] = []

        async def write(b: bytes) -> None:
            out.append(b)

        await relay(answer, lambda: asyncio.sleep(0), write)
        text = b"".join(out)
        assert text.startswith(answer.first) and b'"UpstreamError"' in text  # never silent
        assert text.endswith(b"data: [DONE]\n\n")
        assert legs.decodes[0].closed and len(abandoner.abandoned) == 1
        await until(lambda: idle(pool))

    asyncio.run(go())


@pytest.mark.parametrize(
    "why",
    [{"forces_first_token": False}, {"first_token": False}, {"connector": "nixl-push"}],
    ids=["decode-does-not-declare", "turned-off", "vllm-connector"],
)
def test_without_the_capability_or_when_turned_off_the_first_token_is_decodes(why):
    """Prefill's token goes first only to kvpush decode engines that declare they force it,
    and not with `first_token` off: otherwise the answer waits for decode's first chunk."""

    async def go():
        dispatcher, pool, legs, abandoner = make(**({"connector": "kvpush"} | why))
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.prefills and legs.decodes)
        legs.prefills[0].set_result(PREFILL_ANSWER % b"length")
        await asyncio.sleep(0.01)
        assert not task.done()  # prefill's answer is not sent to the client
        legs.decodes[0].answer(decode_chunk("A"), decode_chunk("B"), b"data: [DONE]\n\n")
        answer = await task
        assert answer.skip is None and answer.first == decode_chunk("A")
        out: list[bytes] = []

        async def write(b: bytes) -> None:
            out.append(b)

        await relay(answer, lambda: asyncio.sleep(0), write)
        assert b"".join(out).count(b'"text":"A"') == 1
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_close_ends_the_prefill_legs_that_outlive_their_handlers():
    """At shutdown a prefill leg may still run after its answer was relayed whole (vLLM's
    push: decode may answer before prefill): `close` ends it. Decode's response went back to
    the transport, released (tests/proxy/test_legs.py: what the HTTP layer does with it)."""

    async def go():
        dispatcher, pool, legs, _ = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: legs.decode_calls)
        decode = legs.decodes[0]
        decode.chunks.put_nowait(b"data: 1\n\n")
        answer = await task
        decode.chunks.put_nowait(b"data: [DONE]\n\n")
        await relay(answer, lambda: asyncio.sleep(0), lambda b: asyncio.sleep(0))
        prefill = legs.prefills[0]
        assert not prefill.done() and decode.released and not decode.closed
        await dispatcher.close()
        assert prefill.cancelled()
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_a_streamed_request_is_accepted_once_decode_has_and_before_prefills_answer():
    """The client's headers go out when decode accepts, so that the first token later leaves
    in one write; a request decode refuses, or one not streamed, is never accepted."""

    async def go():
        dispatcher, pool, legs, _ = make(connector="kvpush")
        accepted: list[int] = []

        async def accept() -> None:
            accepted.append(len(legs.decodes))

        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None), accept))
        await until(lambda: accepted)
        assert accepted == [1] and not legs.prefills[0].done() and not task.done()
        legs.prefills[0].set_result(PREFILL_ANSWER % b"length")
        answer = await task
        assert answer.skip is not None and accepted == [1]  # once
        legs.decodes[0].answer(decode_chunk("A"), b"data: [DONE]\n\n")
        await relay(answer, lambda: asyncio.sleep(0), lambda b: asyncio.sleep(0))
        await until(lambda: idle(pool))

        whole = STREAM | {"stream": False}
        task = asyncio.ensure_future(dispatcher.dispatch(whole, False, {}, Trace(None), accept))
        await until(lambda: len(legs.decodes) == 2)
        legs.prefills[1].set_result(PREFILL_ANSWER % b"length")
        legs.decodes[1].answer(b'{"choices": []}')
        await task
        assert accepted == [1]

    asyncio.run(go())


@pytest.mark.parametrize("lost", [EngineUnreachable, LegBroken])
def test_a_prefill_whose_connection_fails_is_marked_down_and_the_request_re_sent(lost):
    """The legs raise the dispatcher's own errors (proxy.app turns aiohttp's into them)."""

    async def go():
        dispatcher, pool, legs, _ = make()
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, Trace(None)))
        await until(lambda: len(legs.prefills) == 1)
        legs.prefills[0].set_exception(lost("p0: reset"))
        await until(lambda: len(legs.prefills) == 2)
        assert [s.healthy for s in pool.states] == [False, True, True]
        legs.prefills[1].set_result(b"{}")
        await until(lambda: len(legs.decodes) == 2)
        legs.decodes[1].chunks.put_nowait(b"data: x\n\n")
        (await task).finish(True)
        await until(lambda: idle(pool))

    asyncio.run(go())


@pytest.mark.parametrize(("error", "status"), [(LegTimeout, 504), (LegError, 502)])
def test_a_prefill_leg_that_times_out_or_fails_otherwise_is_not_re_sent(error, status):
    async def go():
        dispatcher, pool, legs, _ = make()
        body = STREAM | {"stream": False}
        task = asyncio.ensure_future(dispatcher.dispatch(body, False, {}, Trace(None)))
        await until(lambda: len(legs.prefills) == 1)
        legs.prefills[0].set_exception(error("p0: no answer"))
        with pytest.raises(ProxyError) as failed:
            await task
        assert failed.value.status == status and len(legs.prefills) == 1
        assert all(s.healthy for s in pool.states)
        await until(lambda: idle(pool))

    asyncio.run(go())
