"""Conditional disaggregation (kvpush.proxy.paths): the choice from measured costs, and the
dispatcher taking it with in-memory legs. tests/e2e/test_paths.py runs both paths on real
engines and checks their answers against one plain engine's."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.proxy.config import EngineInfo, EngineState
from kvpush.proxy.paths import (
    CYCLE,
    EXPLORE,
    PLAIN,
    SETTLE,
    SPLIT,
    PrefillRate,
    Ways,
    choose,
    plain_engine,
)
from kvpush.proxy.prefix import block_hashes
from kvpush.proxy.relay import relay
from kvpush.proxy.timeline import Trace
from tests.proxy.test_dispatch import STREAM, idle, make, until

# what reaches the engine: a stream that can move asks for its token ids (proxy.migrate)
MOVABLE = STREAM | {"return_token_ids": True}


def engine(role: str, queued: int = 0, decoding: int = 0) -> EngineState:
    e = EngineState(EngineInfo(f"http://{role}", role, role))
    e.local_tokens, e.decoding = queued, decoding
    return e


def measured(split: tuple[float, float], plain: tuple[float, float], n: int = 8) -> Ways:
    """Ways with `n` measured streams of 32 tokens each way (TTFT s, TPOT s)."""
    ways = Ways()
    for _ in range(n):
        ways.observe("push", *split, 32)
        ways.observe("local", *plain, 32)
    return ways


def test_always_pushes_and_never_serves_whole():
    p, d = engine("prefill"), engine("decode")
    assert choose("always", [p, d], Ways(), 100).path == "push"
    never = choose("never", [p, d], Ways(), 100)
    assert never.path == "local" and never.engine is d  # a tie: decode first
    assert not never.measured


def test_auto_runs_in_cycles_the_other_way_last_and_the_first_of_each_run_unmeasured():
    p, d = engine("prefill"), engine("decode")
    ways = Ways()
    got = [choose("auto", [p, d], ways, 100) for _ in range(CYCLE + 1)]
    explore_from = CYCLE - EXPLORE
    assert [c.path for c in got[:explore_from]] == ["local"] * explore_from  # plain first
    assert [c.path for c in got[explore_from:CYCLE]] == ["push"] * EXPLORE
    assert got[CYCLE].path == "local"  # nothing measured: plain stays
    measured = [i for i, c in enumerate(got) if c.measured]
    assert measured == [*range(SETTLE, explore_from), *range(explore_from + SETTLE, CYCLE)]


def run_cycle_into_the_next(ways: Ways, p, d) -> list:
    return [choose("auto", [p, d], ways, 100) for _ in range(CYCLE + SETTLE + 1)]


def test_auto_takes_the_other_way_when_its_run_ended_sooner():
    p, d = engine("prefill"), engine("decode")
    # pushed: 0.25 s + 31 x 7 ms = 0.467 s; whole: 0.25 s + 31 x 5 ms = 0.405 s
    ways = measured(split=(0.25, 0.005), plain=(0.25, 0.007))
    assert ways.cost(SPLIT) == pytest.approx(0.25 + 31 * 0.005)
    got = run_cycle_into_the_next(ways, p, d)
    assert ways.current == SPLIT and got[-1].path == "push"
    # the other way round: plain stays
    ways = measured(split=(0.25, 0.007), plain=(0.25, 0.005))
    assert run_cycle_into_the_next(ways, p, d)[-1].path == "local" and ways.current == PLAIN
    # within the margin (5 %): the current way stays
    ways = measured(split=(0.25, 0.005), plain=(0.25, 0.0052))
    run_cycle_into_the_next(ways, p, d)
    assert ways.current == PLAIN


def test_ways_measure_only_streams_that_ended_well_with_a_tpot():
    ways = Ways()
    ways.observe("push", 0.2, 0.006, 32)
    ways.observe("whole", 0.3, 0.004, 32)
    ways.observe("local", 0.3, 0.004, 32)  # local and whole are one way: plain
    ways.observe("push", 0.2, None, 1)  # not streamed
    ways.observe("push", None, 0.006, 32)
    assert len(ways.done[SPLIT]) == 1 and len(ways.done[PLAIN]) == 2
    assert ways.cost(SPLIT) is None  # fewer than MIN_SAMPLES


def test_the_plain_engine_is_the_least_loaded_then_the_one_holding_the_prefix():
    p, d = engine("prefill"), engine("decode")
    assert plain_engine([p, d], 100) is d  # a tie: decode first
    d.local_tokens = 500
    assert plain_engine([p, d], 100) is p
    d.local_tokens = 0
    d.decoding = 2
    assert plain_engine([p, d], 100) is p
    # prefill holds the prompt's prefix: prefill, less work, though a tie picks decode
    d.decoding = 0
    body = {"prompt": list(range(256))}
    hashes = block_hashes(body, chat=False)
    assert p.prefix is not None and d.prefix is not None  # both cache, by default
    p.prefix.add(hashes[:4])
    assert plain_engine([p, d], 256, hashes) is p
    # an engine that keeps no prefix cache is never credited with one
    off = EngineState(EngineInfo("http://d2", "decode", "d2", prefix_caching=False))
    assert off.prefix is None and plain_engine([off], 256, hashes) is off


def test_a_rate_is_a_moving_average_of_seconds_per_queued_token():
    r = PrefillRate()
    r.observe_prompt(0.2, 2000)
    assert r.s_per_token == pytest.approx(1e-4) and r.samples == 1
    r.observe_prompt(0.6, 2000)  # 3e-4 moves the average a fifth of the way
    assert r.s_per_token == pytest.approx(1.4e-4)
    r.observe_prompt(0.0, 2000)  # nothing to learn from
    r.observe_prompt(0.1, 0)
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


def test_the_dispatcher_counts_each_path_and_measures_each_way():
    async def go():
        dispatcher, pool, legs, _ = make(num_prefill=1, connector="kvpush", disaggregation="auto")
        dispatcher.ways = Ways(current=SPLIT, turn=SETTLE)  # past the unmeasured start
        trace = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, trace))
        await until(lambda: legs.prefill_calls and legs.decode_calls)
        legs.prefills[0].set_result(b'{"choices": [{"text": "x"}]}')
        legs.decodes[0].answer(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")
        await relay(await task, lambda: asyncio.sleep(0), lambda b: asyncio.sleep(0))
        assert trace.path == "push" and trace.measured
        assert dispatcher.metrics.path.labels("push")._value.get() == 1
        assert [len(dispatcher.ways.done[w]) for w in (SPLIT, PLAIN)] == [1, 0]
        assert idle(pool)

    asyncio.run(go())


def test_whole_sends_the_request_unchanged_to_the_prefill_engine_as_a_plain_one():
    async def go():
        dispatcher, pool, legs, abandoner = make(
            num_prefill=1, connector="kvpush", disaggregation="auto"
        )
        prefill, decode = pool.states
        # whole requests measured the sooner, and decode busy decoding two streams: the
        # plain engine is prefill
        prefill.rate.observe_prompt(0.2, 2000)
        decode.decoding = 2
        dispatcher.ways = Ways()  # plain, as it starts
        trace = Trace(None)
        task = asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, trace))
        await until(lambda: legs.decode_calls)
        (engine_id, body), answer_leg = legs.decode_calls[0], legs.decodes[0]
        assert engine_id == "p0" and legs.prefill_calls == [] and body == MOVABLE
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
        assert engine_id == "p0" and body == MOVABLE and legs.prefill_calls == []
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
        tasks = [asyncio.ensure_future(dispatcher.dispatch(STREAM, False, {}, t)) for t in traces]
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


def test_prefill_engines_are_picked_for_the_prefix_they_hold_and_tpot_is_measured_per_path():
    """Two prefill engines: a prompt sharing the first one's prefix goes there again, where
    round-robin would send it to the second; new prompts (a tie) go round-robin. Each
    streamed answer's TPOT goes into its path's average."""

    async def go():
        dispatcher, pool, legs, _ = make(num_prefill=2, connector="kvpush", disaggregation="always")
        shared = list(range(1000, 1512))
        prompts = [shared + [1], shared + [2], list(range(5000, 5512)), list(range(6000, 6512))]
        sent = []
        for i, prompt in enumerate(prompts):
            body = dict(STREAM, prompt=prompt)
            task = asyncio.ensure_future(dispatcher.dispatch(body, False, {}, Trace(None)))
            await until(lambda i=i: len(legs.prefill_calls) == i + 1 and legs.decodes[i:])
            sent.append(legs.prefill_calls[i][0])
            legs.prefills[i].set_result(b'{"choices": [{"text": "x"}]}')
            legs.decodes[i].answer(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")
            answer = await task
            await relay(answer, lambda: asyncio.sleep(0), lambda b: asyncio.sleep(0))
        assert sent == ["p0", "p0", "p0", "p1"]
        assert [len(dispatcher.ways.done[w]) for w in (SPLIT, PLAIN)] == [0, 0]  # always
        assert idle(pool)

    asyncio.run(go())
