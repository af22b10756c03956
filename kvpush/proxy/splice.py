"""The client's first token from prefill's answer, then decode's stream without it.

With kvpush's connector, decode continues from the token prefill sampled (kvpush.vllm.
firsttoken), so the proxy can send that token the moment prefill answers instead of waiting
for the KV, decode's scheduling and its first step. `first_token` turns prefill's answer into
the stream's first events, shaped as vLLM shapes them (for chat, the role chunk first; the
same `id`, `created` and `model` as decode's later chunks). `Skip` then filters decode's
stream: it drops the first token (text, logprobs, token ids) and the role chunk the client
already has, parsing only the events up to that point; the rest passes through as bytes.

Some requests cannot be split this way, and are answered from decode's stream whole, as
before: `echo`, `prompt_logprobs`, continuous usage stats, chat with tools or a reasoning
parser's output, a first token whose text is an incomplete character, or one whose text could
be the start of a stop string (decode would hold it back, and perhaps never send it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_EVENT_END = b"\n\n"
_DONE_EVENT = b"data: [DONE]"


@dataclass
class FirstToken:
    events: bytes  # what the client gets first: SSE events (ending with [DONE] if `ends`)
    ends: bool  # prefill's token ends the answer: decode's leg is not needed
    text: str  # the first token's text, as decode will stream it
    created: int


def first_token(answer: bytes, body: dict, chat: bool) -> FirstToken | None:
    """The stream's first events from prefill's (non-streamed, one-token) answer, or None when
    this request must be answered from decode's stream whole (or the answer is not shaped as
    vLLM's)."""
    try:
        return _first_token(answer, body, chat)
    except (msgspec.DecodeError, KeyError, IndexError, TypeError, AttributeError, ValueError):
        return None


def _first_token(answer: bytes, body: dict, chat: bool) -> FirstToken | None:
    if body.get("echo") or body.get("prompt_logprobs") is not None or body.get("tools"):
        return None
    options = body.get("stream_options") or {}
    if options.get("continuous_usage_stats"):
        return None
    p = msgspec.json.decode(answer)
    choice = p["choices"][0]
    if chat:
        message = choice.get("message") or {}
        text = message.get("content")
        if message.get("tool_calls") or message.get("reasoning") or message.get(
            "reasoning_content"):  # fmt: skip
            return None
    else:
        text = choice.get("text")
    if not isinstance(text, str) or text.endswith("\ufffd"):
        return None
    finish = choice.get("finish_reason")
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    ends = finish == "stop" or limit == 1
    if not ends and _may_start_stop(text, body.get("stop")):
        return None
    head = {"id": p["id"], "object": "", "created": p["created"], "model": p["model"]}
    fin = (finish if ends else None), (choice.get("stop_reason") if ends else None)
    events = []
    if chat:
        head["object"] = "chat.completion.chunk"
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip
        first = head | {"choices": [role]}
        if p.get("prompt_token_ids") is not None:
            first["prompt_token_ids"] = p["prompt_token_ids"]
        events.append(first)
        token = {"index": 0, "delta": {"content": text}, "logprobs": choice.get("logprobs"),
                 "finish_reason": fin[0]}  # fmt: skip
        if ends:
            token["stop_reason"] = fin[1]
        if choice.get("token_ids") is not None:
            token["token_ids"] = choice["token_ids"]
        events.append(head | {"choices": [token]})
    else:
        head["object"] = "text_completion"
        token = {
            "index": 0,
            "text": text,
            "logprobs": choice.get("logprobs"),
            "finish_reason": fin[0],
            "stop_reason": fin[1],
            "prompt_token_ids": choice.get("prompt_token_ids"),
            "token_ids": choice.get("token_ids"),
        }
        events.append(head | {"choices": [token]})
    if ends and options.get("include_usage"):
        usage = p.get("usage") or {}
        usage = {k: usage.get(k, 0) for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
        events.append(head | {"choices": [], "usage": usage})
    data = b"".join(b"data: " + msgspec.json.encode(e) + _EVENT_END for e in events)
    if ends:
        data += _DONE_EVENT + _EVENT_END
    return FirstToken(data, ends, text, int(p["created"]))


def _may_start_stop(text: str, stop: Any) -> bool:
    """Whether the end of `text` could begin a stop string: decode would then hold the text
    back until it knows, and drop it if the stop string completes."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return any(
        s and text and any(text.endswith(s[:n]) for n in range(1, len(s) + 1)) for s in stops
    )


class Skip:
    """Decode's stream, less what the client already has from prefill: the first token (its
    text, logprobs and token id, wherever decode's chunks put them, even several tokens to a
    chunk or text held back for stop strings) and, for chat, the role chunk. Once past it,
    bytes pass through untouched (save `created`, should decode's clock have ticked over)."""

    def __init__(self, first: FirstToken, chat: bool) -> None:
        self.chat = chat
        self.created = first.created
        self._chars = len(first.text)
        self._tokens = 1
        self._role = chat
        self._buffer = b""
        self._patch: tuple[bytes, bytes] | None = None
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """What to forward to the client of this piece of decode's stream."""
        if self.done:
            return self._patched(data)
        self._buffer += data
        out = []
        while not self.done and (end := self._buffer.find(_EVENT_END)) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + len(_EVENT_END) :]
            kept = self._event(event)
            if kept is not None:
                out.append(kept + _EVENT_END)
        if self.done:
            out.append(self._patched(self._buffer))
            self._buffer = b""
        return b"".join(out)

    def _patched(self, data: bytes) -> bytes:
        if self._patch is None:
            return data
        return data.replace(*self._patch)

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data: ") or event.startswith(_DONE_EVENT):
            self.done = True  # nothing to skip any more (an error, or the end)
            return event
        obj = event_json(event)
        if obj is None:
            return event
        created = obj.get("created")
        if isinstance(created, int) and created != self.created:
            obj["created"] = self.created
            self._patch = (b'"created":%d' % created, b'"created":%d' % self.created)
        choices = obj.get("choices")
        if not choices:  # a usage chunk or an error: nothing of the first token in it
            self.done = self._tokens == 0 and self._chars == 0 and not self._role
            return b"data: " + msgspec.json.encode(obj)
        self._strip(obj, choices[0])
        self.done = self._tokens == 0 and self._chars == 0 and not self._role
        if empty_choice(choices[0], self.chat) and "usage" not in obj:
            return None
        return b"data: " + msgspec.json.encode(obj)

    def _strip(self, obj: dict, choice: dict) -> None:
        obj.pop("prompt_token_ids", None)  # sent with the first token
        obj.pop("prompt_text", None)
        choice.pop("prompt_token_ids", None)
        if self.chat:
            delta = choice.setdefault("delta", {})
            if self._role and "role" in delta:
                self._role = False
                del delta["role"]
                if not delta.get("content"):
                    delta.pop("content", None)
                    return
            self._role = False
            text = delta.get("content") or ""
            cut = min(self._chars, len(text))
            if "content" in delta:
                delta["content"] = text[cut:]
        else:
            text = choice.get("text") or ""
            cut = min(self._chars, len(text))
            choice["text"] = text[cut:]
        self._chars -= cut
        if self._tokens == 0:
            return
        lists = _token_lists(choice, self.chat)
        sizes = {len(v) for v in lists}
        n = min(self._tokens, min(sizes)) if sizes else self._tokens
        for values in lists:
            del values[:n]
        self._tokens -= n
        if self.chat and choice.get("logprobs") == {"content": []}:
            choice["logprobs"] = None


def _token_lists(choice: dict, chat: bool) -> list[list]:
    """The per-token lists of a chunk's choice: token ids and logprobs."""
    lists = []
    if isinstance(choice.get("token_ids"), list):
        lists.append(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        keys = ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        lists += [logprobs[k] for k in keys if isinstance(logprobs.get(k), list)]
    return lists


def event_json(event: bytes) -> dict | None:
    """An SSE event's data as a JSON object; None for anything else (`[DONE]`, a comment,
    data that is not a JSON object)."""
    if not event.startswith(b"data: ") or event.startswith(_DONE_EVENT):
        return None
    try:
        obj = msgspec.json.decode(event[6:])
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def empty_choice(choice: dict, chat: bool) -> bool:
    """Nothing left for the client in this choice."""
    if choice.get("finish_reason") is not None:
        return False
    if any(_token_lists(choice, chat)):
        return False
    if chat:
        return not (choice.get("delta") or {}).get("content") and not choice.get("delta", {}).get(
            "tool_calls")  # fmt: skip
    return not choice.get("text")
