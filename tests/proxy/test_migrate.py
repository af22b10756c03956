"""Migration without HTTP: a stream whose engine fails mid-answer goes on from another engine
(kvpush.proxy.migrate), over the in-memory legs of test_dispatch. The same on real engines,
killed mid-stream: tests/e2e/test_migration.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpush.proxy.config import EngineInfo, ProxyConfig
from kvpush.proxy.dispatch import Dispatcher
from kvpush.proxy.legs import LegBroken
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.migrate import Progress, Rewriter, unsupported
from kvpush.proxy.pool import EnginePool
from kvpush.proxy.relay import relay
from kvpush.proxy.timeline import Trace
from tests.proxy.test_dispatch import FakeAbandoner, FakeLegs, idle, until

PROMPT = [5, 6, 7]
DONE = b"data: [DONE]\n\n"


def make(**settings):
    """One prefill and two decode engines (d0, d1); kvpush, every prompt pushed."""
    engines = (EngineInfo("http://p0", "prefill", "p0"),)
    engines += tuple(
        EngineInfo(f"http://d{i}", "decode", f"d{i}", forces_first_token=True) for i in range(2)
    )
    settings = {"disaggregation": "always", "policy": "round-robin"} | settings
    config = ProxyConfig(engines=engines, connector="kvpush", **settings)
    pool, legs, metrics = EnginePool(config), FakeLegs(), ProxyMetrics()
    return Dispatcher(config, pool, legs, metrics, FakeAbandoner()), pool, legs, metrics


def prefill_answer(text: str, token_id: int, chat: bool = False) -> bytes:
    """Prefill's one-token answer with token ids, as vLLM shapes it."""
    head = {"id": "cmpl-1", "created": 7, "model": "tiny", "usage": {"prompt_tokens": 3}}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "length", "token_ids": [token_id]}  # fmt: skip
        return json.dumps(head | {"prompt_token_ids": PROMPT, "choices": [choice]}).encode()
    choice = {"index": 0, "text": text, "finish_reason": "length",
              "prompt_token_ids": PROMPT, "token_ids": [token_id]}  # fmt: skip
    return json.dumps(head | {"choices": [choice]}).encode()


def chunk(text: str, token_id: int, chat: bool = False, finish: str | None = None, **head) -> bytes:
    """One streamed event of one token, with its id, as vLLM sends it (return_token_ids)."""
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
        obj = {"id": "cmpl-1", "object": "text_completion"}
    obj |= {"created": 7, "model": "tiny"} | head
    return (
        b"data: "
        + json.dumps(obj | {"choices": [choice | {"token_ids": [token_id]}]}).encode()
        + b"\n\n"
    )


def events(data: bytes) -> list:
    """The client's stream as events: JSON objects, and "[DONE]"."""
    out = []
    for event in data.split(b"\n\n"):
        if event:
            assert event.startswith(b"data: "), event
            out.append("[DONE]" if event == b"data: [DONE]" else json.loads(event[6:]))
    return out


def text(evs: list, chat: bool = False) -> str:
    out = ""
    for e in evs:
        for c in e != "[DONE]" and e.get("choices") or ():
            out += (c.get("delta") or {}).get("content", "") if chat else c["text"]
    return out


async def start(dispatcher, legs, body, chat=False):
    """A streamed request to the point where the client has prefill's token; the answer."""
    task = asyncio.ensure_future(dispatcher.dispatch(body, chat, {}, Trace(None)))
    await until(lambda: legs.prefills and legs.decodes)
    legs.prefills[0].set_result(prefill_answer("A", 10, chat))
    return await task


async def run_relay(answer) -> list:
    out: list[bytes] = []

    async def write(b: bytes) -> None:
        out.append(b)

    await relay(answer, lambda: asyncio.sleep(0), write)
    return events(b"".join(out))


BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True}


@pytest.mark.parametrize(
    "failure",
    [LegBroken("reset"), b'data: {"error": {"message": "EngineDeadError"}}\n\n', None],
    ids=["connection-lost", "error-event", "ended-early"],
)
def test_a_stream_whose_decode_fails_continues_on_the_other_decode_engine(failure):
    async def go():
        dispatcher, pool, legs, metrics = make()
        answer = await start(dispatcher, legs, BODY)
        d0 = legs.decodes[0]
        tail = [failure] if failure is not None else []
        d0.answer(chunk("A", 10), chunk("B", 11), *tail)
        relaying = asyncio.ensure_future(run_relay(answer))
        await until(lambda: len(legs.decodes) == 2)
        engine_id, cont = legs.decode_calls[1]
        # the rest, computed from the prompt and the tokens the client has, as a plain request
        assert engine_id == "d1" and cont["prompt"] == PROMPT + [10, 11]
        assert cont["max_tokens"] == 3 and "kv_transfer_params" not in cont
        legs.decodes[1].answer(
            chunk("C", 12, id="cmpl-2", created=9),
            chunk("D", 13) + chunk("E", 14, finish="length"),
            b'data: {"id":"cmpl-2","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}'
            b"\n\n",
            DONE,
        )
        evs = await relaying
        assert text(evs) == "ABCDE" and evs[-1] == "[DONE]"
        assert all(e["id"] == "cmpl-1" and e["created"] == 7 for e in evs[:-1])
        assert all("token_ids" not in c for e in evs[:-1] for c in e["choices"])  # not asked
        assert [c["finish_reason"] for e in evs[:-1] for c in e["choices"]][-1] == "length"
        assert not any("error" in e for e in evs[:-1])
        cause = {LegBroken: "broken", bytes: "error", type(None): "ended"}[type(failure)]
        assert metrics.migrated.labels(cause)._value.get() == 1
        assert answer.trace.migrations == [cause] and answer.trace.status == "ok"
        assert d0.closed and legs.decodes[1].released
        assert pool.states[1].healthy == (cause != "broken")  # a lost connection marks it
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_usage_counts_the_whole_answer_and_the_client_keeps_its_token_ids():
    async def go():
        dispatcher, pool, legs, _ = make()
        body = BODY | {"return_token_ids": True, "stream_options": {"include_usage": True}}
        answer = await start(dispatcher, legs, body)
        legs.decodes[0].answer(chunk("A", 10), LegBroken("reset"))
        relaying = asyncio.ensure_future(run_relay(answer))
        await until(lambda: len(legs.decodes) == 2)
        assert legs.decode_calls[1][1]["stream_options"] == {"include_usage": True}
        legs.decodes[1].answer(
            chunk("B", 11, finish="stop"),
            b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1,'
            b'"total_tokens":5}}\n\n',
            DONE,
        )
        evs = await relaying
        ids = [i for e in evs[:-1] for c in e["choices"] for i in c.get("token_ids") or ()]
        assert ids == [10, 11]
        assert evs[-2]["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_a_chat_stream_continues_as_chat_chunks():
    async def go():
        dispatcher, pool, legs, _ = make()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 4, "stream": True}  # fmt: skip
        answer = await start(dispatcher, legs, body, chat=True)
        legs.decodes[0].answer(chunk("A", 10, chat=True), chunk("B", 11, chat=True), None)
        relaying = asyncio.ensure_future(run_relay(answer))
        await until(lambda: len(legs.decodes) == 2)
        assert legs.decode_calls[1][1]["prompt"] == PROMPT + [10, 11]
        assert "messages" not in legs.decode_calls[1][1]
        legs.decodes[1].answer(chunk("C", 12), chunk("D", 13, finish="length"), DONE)
        evs = await relaying
        assert text(evs, chat=True) == "ABCD"
        assert {e["object"] for e in evs[:-1]} == {"chat.completion.chunk"}
        assert evs[0]["choices"][0]["delta"]["role"] == "assistant"
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_after_max_migrations_the_stream_ends_with_an_error_event():
    async def go():
        dispatcher, pool, legs, metrics = make(max_migrations=1)
        answer = await start(dispatcher, legs, BODY)
        legs.decodes[0].answer(chunk("A", 10), None)
        relaying = asyncio.ensure_future(run_relay(answer))
        await until(lambda: len(legs.decodes) == 2)
        legs.decodes[1].answer(chunk("B", 11), None)  # the continuation fails too
        evs = await relaying
        assert text(evs) == "AB" and evs[-2]["error"]["type"] == "UpstreamError"
        assert evs[-1] == "[DONE]" and len(legs.decodes) == 2
        assert metrics.lost.labels("ended")._value.get() == 1
        assert answer.trace.status == "ended early"
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_an_answer_complete_but_for_its_end_is_ended_by_the_proxy():
    async def go():
        dispatcher, pool, legs, _ = make()
        body = BODY | {"stream_options": {"include_usage": True}}
        answer = await start(dispatcher, legs, body)
        legs.decodes[0].answer(chunk("A", 10), chunk("B", 11, finish="stop"), None)
        evs = await run_relay(answer)
        assert text(evs) == "AB" and len(legs.decodes) == 1  # no engine asked
        assert evs[-2]["usage"]["completion_tokens"] == 2 and evs[-1] == "[DONE]"
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_a_request_that_cannot_be_continued_is_relayed_as_bytes():
    async def go():
        dispatcher, pool, legs, metrics = make()
        body = BODY | {"stop": ["\n"]}
        task = asyncio.ensure_future(dispatcher.dispatch(body, False, {}, Trace(None)))
        await until(lambda: legs.prefills and legs.decodes)
        assert "return_token_ids" not in legs.decode_calls[0][1]
        legs.prefills[0].set_result(prefill_answer("A", 10))
        answer = await task
        legs.decodes[0].answer(chunk("A", 10), LegBroken("reset"))
        evs = await run_relay(answer)
        assert evs[-2]["error"]["code"] == 502 and len(legs.decodes) == 1
        assert metrics.lost.labels("broken")._value.get() == 1
        await until(lambda: idle(pool))

    asyncio.run(go())


@pytest.mark.parametrize(
    "extra, reason",
    [
        ({"stop": "x"}, "stop strings"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "presence or frequency penalty"),
        ({"stream": False}, "not streamed"),
    ],
)
def test_what_cannot_be_continued_says_why(extra, reason):
    assert unsupported(BODY | extra, False) == reason
    assert unsupported(BODY | {"response_format": {"type": "text"}}, False) is None


def test_progress_forwards_whole_events_and_holds_back_an_engine_error():
    progress = Progress(BODY, chat=False)
    data = chunk("A", 10)
    assert progress.feed(data[:10]) == b""  # half an event waits for its end
    out = progress.feed(data[10:] + b'data: {"error": {"message": "boom"}}\n\n' + DONE)
    assert b'"text":"A"' in out and b"token_ids" not in out and b"error" not in out
    assert progress.error == "boom" and progress.token_ids == [10]


def test_the_continuation_keeps_the_sampling_drops_the_seed_and_counts_min_tokens():
    progress = Progress(BODY, chat=False)
    progress.feed(chunk("A", 10) + chunk("B", 11))
    body = BODY | {"seed": 3, "min_tokens": 3, "temperature": 0.7, "top_k": 5}
    cont = progress.continuation(body)
    assert cont is not None and "seed" not in cont
    assert cont["prompt"] == PROMPT + [10, 11] and cont["max_tokens"] == 3
    assert cont["min_tokens"] == 1 and cont["temperature"] == 0.7 and cont["top_k"] == 5


def test_a_stream_without_token_ids_cannot_be_continued():
    progress = Progress(BODY, chat=False)
    progress.feed(b'data: {"choices": [{"index": 0, "text": "A"}]}\n\n')
    assert progress.continuation(BODY) is None


def test_the_rewriter_turns_a_completion_into_the_clients_chat_stream():
    progress = Progress({"stream": True}, chat=True)
    progress.feed(chunk("A", 10, chat=True, prompt_token_ids=PROMPT))
    out = events(Rewriter(progress).feed(chunk("B", 11, id="cmpl-9")))
    assert out[0]["id"] == "chatcmpl-1" and out[0]["object"] == "chat.completion.chunk"
    assert out[0]["choices"][0]["delta"] == {"content": "B"}


class FailingLegs(FakeLegs):
    """The first decode leg's connection is lost before its headers."""

    async def decode(self, engine, chat, body, headers):
        if not self.decode_calls:
            self.decode_calls.append((engine.info.engine_id, body))
            raise LegBroken("reset before headers")
        return await super().decode(engine, chat, body, headers)


def test_an_engine_lost_before_the_client_got_a_byte_serves_the_request_whole_elsewhere():
    async def go():
        dispatcher, pool, _, metrics = make()
        dispatcher.legs = dispatcher.run.legs = legs = FailingLegs()
        task = asyncio.ensure_future(dispatcher.dispatch(BODY, False, {}, Trace(None)))
        await until(lambda: legs.decodes)
        engine_id, whole = legs.decode_calls[1]
        assert legs.decode_calls[0][0] == "d0" and engine_id != "d0"
        assert "kv_transfer_params" not in whole and whole["prompt"] == PROMPT
        legs.decodes[0].answer(chunk("A", 10), chunk("B", 11, finish="stop"), DONE)
        answer = await task
        evs = await run_relay(answer)
        assert text(evs) == "AB" and answer.trace.reroutes == ["whole"]
        assert metrics.rerouted.labels("whole")._value.get() == 1
        assert not pool.states[1].healthy  # the lost one, until a health check passes
        await until(lambda: idle(pool))

    asyncio.run(go())


def test_a_prefill_engine_lost_before_decodes_first_chunk_moves_the_stream_at_once():
    """Decode would learn of it from its own liveness check, seconds later; the proxy moves
    the stream as soon as it takes the prefill engine out of rotation."""

    async def go():
        dispatcher, pool, legs, metrics = make()
        answer = await start(dispatcher, legs, BODY)
        relaying = asyncio.ensure_future(run_relay(answer))
        await asyncio.sleep(0.01)
        assert len(legs.decodes) == 1  # waiting on decode's first chunk
        pool.mark_failed(pool.states[0], LegBroken("p0 refused"))
        await until(lambda: len(legs.decodes) == 2)
        assert legs.decode_calls[1][1]["prompt"] == PROMPT + [10]  # from prefill's token
        legs.decodes[1].answer(chunk("B", 11), chunk("C", 12, finish="stop"), DONE)
        evs = await relaying
        assert text(evs) == "ABC" and answer.trace.migrations == ["prefill"]
        assert metrics.migrated.labels("prefill")._value.get() == 1
        assert legs.decodes[0].closed
        await until(lambda: idle(pool))

    asyncio.run(go())


@pytest.mark.parametrize(
    "bad", [{"response_format": "json"}, {"stream_options": "x"}], ids=["format", "options"]
)
def test_malformed_options_are_left_to_the_engine_to_refuse(bad):
    assert unsupported(BODY | bad, False) is not None  # not migrated, and no crash here
