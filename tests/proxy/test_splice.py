"""The first token from prefill's answer and decode's stream without it, on events shaped as
vLLM 0.32 shapes them (copied from a real engine's output). The e2e tests check the whole
stream against one plain engine's."""

from __future__ import annotations

import json

from kvpush.proxy.splice import Skip, first_token

PREFILL = {
    "id": "cmpl-r1", "object": "text_completion", "created": 100, "model": "tiny",
    "choices": [{"index": 0, "text": "end", "finish_reason": "length", "stop_reason": None,
                 "logprobs": {"text_offset": [0], "token_logprobs": [0.0], "tokens": ["end"],
                              "top_logprobs": [{"end": 0.0}]},
                 "token_ids": [821], "prompt_token_ids": [1, 2]}],
    "usage": {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1},
}  # fmt: skip


def events(data: bytes) -> list:
    out = []
    for e in data.split(b"\n\n"):
        if e:
            assert e.startswith(b"data: ")
            out.append("[DONE]" if e == b"data: [DONE]" else json.loads(e[6:]))
    return out


def sse(*objs) -> bytes:  # compact, as vLLM writes it
    return b"".join(
        b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n" for o in objs
    )


def chunk(text, tokens=None, finish=None, created=100, **extra):
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "prompt_token_ids": None, "token_ids": tokens}  # fmt: skip
    return {"id": "cmpl-r1", "object": "text_completion", "created": created, "model": "tiny",
            "choices": [choice]} | extra  # fmt: skip


def test_first_event_carries_prefills_token_logprobs_and_ids():
    ft = first_token(json.dumps(PREFILL).encode(), {"max_tokens": 8, "logprobs": 1}, chat=False)
    assert ft is not None and not ft.ends and ft.text == "end"
    (e,) = events(ft.events)
    assert e["id"] == "cmpl-r1" and e["created"] == 100 and e["model"] == "tiny"
    c = e["choices"][0]
    assert c["text"] == "end" and c["finish_reason"] is None and c["token_ids"] == [821]
    assert c["logprobs"]["tokens"] == ["end"] and c["prompt_token_ids"] == [1, 2]


def test_skip_drops_the_first_token_even_inside_a_chunk_of_several():
    ft = first_token(json.dumps(PREFILL).encode(), {"max_tokens": 8}, chat=False)
    skip = Skip(ft, chat=False)
    raw = sse(chunk("endend", [821, 821], prompt_token_ids=[1, 2]))
    (e,) = events(skip.feed(raw[:10]) + skip.feed(raw[10:]))  # split mid-event
    assert e["choices"][0]["text"] == "end" and e["choices"][0]["token_ids"] == [821]
    assert "prompt_token_ids" not in e
    later = sse(chunk(" x", [5])) + b"data: [DONE]\n\n"
    assert skip.done and skip.feed(later) == later  # past the first token: bytes as they are


def test_skip_follows_text_held_back_for_a_stop_string():
    ft = first_token(json.dumps(PREFILL).encode(), {"max_tokens": 8}, chat=False)
    skip = Skip(ft, chat=False)
    assert skip.feed(sse(chunk("", [821]))) == b""  # decode held "end" back
    (e,) = events(skip.feed(sse(chunk("end!", [7]))))
    assert e["choices"][0]["text"] == "!" and e["choices"][0]["token_ids"] == [7]


def test_decodes_clock_is_patched_to_the_first_events():
    ft = first_token(json.dumps(PREFILL).encode(), {"max_tokens": 8}, chat=False)
    skip = Skip(ft, chat=False)
    skip.feed(sse(chunk("end", created=101)))
    (e,) = events(skip.feed(sse(chunk("x", created=101))))
    assert e["created"] == 100


def test_a_token_that_ends_the_answer_ends_the_stream_with_usage():
    answer = json.loads(json.dumps(PREFILL))
    answer["choices"][0]["finish_reason"] = "stop"
    body = {"max_tokens": 8, "stream_options": {"include_usage": True}}
    ft = first_token(json.dumps(answer).encode(), body, chat=False)
    assert ft is not None and ft.ends
    first, usage, done = events(ft.events)
    assert first["choices"][0]["finish_reason"] == "stop" and done == "[DONE]"
    assert usage["usage"] == {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1}
    assert first_token(json.dumps(PREFILL).encode(), {"max_tokens": 1}, chat=False).ends


def test_requests_that_cannot_be_split_are_left_to_decode():
    raw = json.dumps(PREFILL).encode()
    assert first_token(raw, {"echo": True}, chat=False) is None
    assert first_token(raw, {"stop": ["dx"]}, chat=False) is None  # ends with "d": maybe
    assert first_token(raw, {"stop": ["zz"]}, chat=False) is not None
    broken = json.loads(raw)
    broken["choices"][0]["text"] = "\ufffd"
    assert first_token(json.dumps(broken).encode(), {}, chat=False) is None
    cont = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert first_token(raw, cont, chat=False) is None


CHAT = {
    "id": "chatcmpl-r1", "object": "chat.completion", "created": 100, "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ns", "reasoning": None},
                 "logprobs": {"content": [{"token": "ns", "logprob": -0.5}]},
                 "finish_reason": "length", "stop_reason": None, "token_ids": [2330]}],
    "usage": {"prompt_tokens": 12, "total_tokens": 13, "completion_tokens": 1},
    "prompt_token_ids": [1, 2],
}  # fmt: skip


def test_chat_role_chunk_first_then_the_token():
    ft = first_token(json.dumps(CHAT).encode(), {"max_tokens": 8, "logprobs": True}, chat=True)
    role, token = events(ft.events)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["object"] == "chat.completion.chunk" and role["prompt_token_ids"] == [1, 2]
    assert token["choices"][0]["delta"] == {"content": "ns"}
    assert token["choices"][0]["logprobs"]["content"][0]["token"] == "ns"
    skip = Skip(ft, chat=True)
    head = {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 100, "model": "t"}
    decode_role = head | {
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": [1, 2],
    }
    three = head | {"choices": [{"index": 0, "delta": {"content": "nsnsns"},
                    "logprobs": {"content": [{"token": "ns"}] * 3}, "finish_reason": "length",
                    "token_ids": [2330] * 3}]}  # fmt: skip
    usage = head | {"choices": [], "usage": {"completion_tokens": 3}}
    out = events(skip.feed(sse(decode_role, three, usage) + b"data: [DONE]\n\n"))
    assert len(out) == 3 and out[-1] == "[DONE]"
    c = out[0]["choices"][0]
    assert c["delta"] == {"content": "nsns"} and c["token_ids"] == [2330, 2330]
    assert len(c["logprobs"]["content"]) == 2 and c["finish_reason"] == "length"
    assert out[1]["usage"] == {"completion_tokens": 3}
