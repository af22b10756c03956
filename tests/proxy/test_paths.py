"""Conditional disaggregation (kvpush.proxy.paths): the choice from measured costs, and the
dispatcher taking it with in-memory legs. tests/e2e/test_paths.py runs both paths on real
engines and checks their answers against one plain engine's."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.proxy.paths import Choice, Load, PrefillRate, choose
from kvpush.proxy.relay import relay
from kvpush.proxy.timeline import Trace
from tests.proxy.test_dispatch import STREAM, idle, make, until


def rate(s: float | None) -> PrefillRate:
    return PrefillRate(s_per_token=s, samples=0 if s is None else 1)


def load(queued: int, s: float | None, decoding: int = 0) -> Load:
    return Load(queued, decoding, rate(s))


def test_always_pushes_never_computes_on_decode_and_auto_pushes_until_prefill_is_measured():
    args = (100, load(10_000, 1e-3), load(0, 1e-3), 0.1)
    assert choose("always", *args).path == "push"
    assert choose("never", *args).path == "local"
    assert choose("auto", 100, load(10_000, None), load(0, None), 0.1) == Choice("push")


def test_auto_computes_on_decode_only_when_expected_faster_by_the_margin():
    # an idle pair of equal engines: push (decode's rate taken as prefill's)
    assert choose("auto", 2048, load(0, 1e-4), load(0, None), 0.1).path == "push"
    # two prompts queued on prefill: decode, idle, is expected 3x faster
    got = choose("auto", 2048, load(4096, 1e-4), load(0, 1e-4), 0.1)
    assert got.path == "local" and got.push_s == pytest.approx(0.6144)
    assert got.local_s == pytest.approx(0.2048)
    # decode measured slower (its decodes slow its prefills): push unless it still wins
    assert choose("auto", 2048, load(2048, 1e-4), load(0, 1.9e-4), 0.1).path == "push"
    assert choose("auto", 2048, load(2048, 1e-4), load(0, 1.7e-4), 0.1).path == "local"
    # within the margin: push
    assert choose("auto", 1000, load(100, 1e-4), load(0, 1e-4), 0.1).path == "push"


def test_a_prompt_computed_on_prefill_is_decoded_there_when_decode_has_more_decoding():
    assert choose("auto", 2048, load(0, 1e-4, 0), load(0, 1e-4, 1), 0.1).path == "push"
    assert choose("auto", 2048, load(0, 1e-4, 0), load(0, 1e-4, 2), 0.1).path == "whole"
    assert choose("auto", 2048, load(0, 1e-4, 1), load(0, 1e-4, 2), 0.1).path == "push"
    # a prompt decode would compute sooner stays local, whatever is decoding where
    assert choose("auto", 2048, load(4096, 1e-4, 0), load(0, 1e-4, 5), 0.1).path == "local"


def test_a_rate_is_a_moving_average_of_seconds_per_queued_token():
    r = PrefillRate()
    r.observe(0.2, 2000)
    assert r.s_per_token == pytest.approx(1e-4) and r.samples == 1
    r.observe(0.6, 2000)  # 3e-4 moves the average a fifth of the way
    assert r.s_per_token == pytest.approx(1.4e-4)
    r.observe(0.0, 2000)  # nothing to learn from
    r.observe(0.1, 0)
    assert r.samples == 2


def test_the_dispatcher_sends_a_local_request_whole_to_decode_and_counts_its_path():
    async def go():
        dispatcher, pool, legs, abandoner = make(connector="kvpush", disaggregation="never")
        trace = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, trace))
        await until(lambda: legs.decode_calls)
        (_, body), decode = legs.decode_calls[0], legs.decodes[0]
        assert legs.prefill_calls == [] and "kv_transfer_params" not in body
        decode.answer(b"data: 1\n\n", b"data: [DONE]\n\n")
        answer = await task
        answer.finish(True)
        assert trace.path == "local" and trace.transfer_id == ""
        assert dispatcher.metrics.path.labels("local")._value.get() == 1
        decode_state = pool.states[-1]
        assert decode_state.local_tokens == 0 and decode_state.rate.samples == 1
        assert idle(pool) and abandoner.abandoned == []

    asyncio.run(go())


def test_auto_measures_prefill_and_moves_a_prompt_to_decode_when_prefill_is_queued():
    async def go():
        dispatcher, pool, legs, _ = make(num_prefill=1, connector="kvpush")
        prefill, decode = pool.states
        # the first request is pushed, and prefill's time to answer measured
        first = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, first))
        await until(lambda: legs.prefill_calls and legs.decode_calls)
        legs.prefills[0].set_result(b'{"choices": [{"text": "x"}]}')
        legs.decodes[0].answer(b"data: 1\n\n", b"data: [DONE]\n\n")
        (await task).finish(True)
        await until(lambda: prefill.rate.samples == 1)
        assert first.path == "push"
        # a long queue on prefill (as other requests would leave it): the next goes local
        prefill.outstanding_tokens = 1_000_000
        second = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, second))
        await until(lambda: len(legs.decode_calls) == 2)
        assert len(legs.prefill_calls) == 1 and second.path == "local"
        legs.decodes[1].answer(b"data: 1\n\n", b"data: [DONE]\n\n")
        (await task).finish(True)
        counts = {p: dispatcher.metrics.path.labels(p)._value.get() for p in ("push", "local")}
        assert counts == {"push": 1, "local": 1}
        prefill.outstanding_tokens = 0
        assert idle(pool)

    asyncio.run(go())


def test_whole_sends_the_request_unchanged_to_the_prefill_engine_as_a_plain_one():
    async def go():
        dispatcher, pool, legs, abandoner = make(num_prefill=1, connector="kvpush")
        prefill, decode = pool.states
        prefill.rate.observe(0.2, 2000)  # measured, and decode busy decoding two streams
        decode.decoding = 2
        trace = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, trace))
        await until(lambda: legs.decode_calls)
        (engine_id, body), answer_leg = legs.decode_calls[0], legs.decodes[0]
        assert engine_id == "p0" and legs.prefill_calls == [] and body == STREAM
        assert trace.path == "whole" and prefill.local_tokens > 0
        answer_leg.chunks.put_nowait(b"data: 1\n\n")
        answer = await task
        assert prefill.decoding == 1 and prefill.local_tokens == 0
        answer_leg.answer(b"data: [DONE]\n\n")
        await relay(answer, lambda: asyncio.sleep(0), lambda b: asyncio.sleep(0))
        assert prefill.decoding == 0 and prefill.rate.samples == 2
        decode.decoding = 0
        assert idle(pool) and abandoner.abandoned == []

    asyncio.run(go())


def test_with_no_decode_engine_left_a_prefill_engine_serves_requests_whole():
    async def go():
        dispatcher, pool, legs, _ = make(num_prefill=1, connector="kvpush", disaggregation="always")
        prefill, decode = pool.states
        decode.healthy = False
        trace = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, trace))
        await until(lambda: legs.decode_calls)
        (engine_id, body), leg = legs.decode_calls[0], legs.decodes[0]
        assert engine_id == "p0" and body == STREAM and legs.prefill_calls == []
        leg.answer(b"data: 1\n\n", b"data: [DONE]\n\n")
        (await task).finish(True)
        assert trace.path == "whole" and dispatcher.metrics.path.labels("whole")._value.get() == 1
        decode.healthy = True
        assert idle(pool)

    asyncio.run(go())


def test_never_serves_whole_requests_on_every_engine_as_plain_replicas():
    """Two requests at once: the first to decode (a tie), the second to prefill, where
    nothing is queued; neither is pushed."""

    async def go():
        dispatcher, pool, legs, _ = make(num_prefill=1, connector="kvpush", disaggregation="never")
        traces = [Trace(None), Trace(None)]
        tasks = [
            asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, t)) for t in traces
        ]
        await until(lambda: len(legs.decode_calls) == 2)
        assert [engine for engine, _ in legs.decode_calls] == ["d0", "p0"]
        assert [t.path for t in traces] == ["local", "whole"] and legs.prefill_calls == []
        for leg in legs.decodes:
            leg.answer(b"data: 1\n\n", b"data: [DONE]\n\n")
        for task in tasks:
            (await task).finish(True)
        assert idle(pool)

    asyncio.run(go())


def test_vllms_own_connectors_always_push():
    async def go():
        dispatcher, pool, legs, _ = make(connector="nixl-push", disaggregation="never")
        trace = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, trace))
        await until(lambda: legs.prefill_calls)
        assert trace.path == "push"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())


def test_bad_settings_are_refused_naming_the_accepted_ones():
    from kvpush.proxy.config import EngineInfo, ProxyConfig

    engines = (EngineInfo("http://p", "prefill"), EngineInfo("http://d", "decode"))
    with pytest.raises(ValueError, match=r"disaggregation must be one of \('auto', 'always'"):
        ProxyConfig(engines=engines, disaggregation="sometimes")
    with pytest.raises(ValueError, match=r"local_margin must be in \[0, 1\)"):
        ProxyConfig(engines=engines, local_margin=1.5)
