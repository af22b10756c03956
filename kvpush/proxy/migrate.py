"""A stream continued on another engine when its engine fails mid-answer (migration).

The proxy holds the prompt and relays every token the client gets, and a kvpush engine
computes a prompt given as token ids exactly as it would have decoded it. So when a streamed
answer fails after the client has tokens (the engine's connection is lost, it sends an error
event, or its stream ends before `[DONE]`), the proxy asks a healthy engine for the rest: the
prompt's token ids and every token already sent, as one plain completion, with the limits
less what was sent. The client sees one stream: the continuation's events are rewritten to
the first stream's `id`, `created` and `model` (and, for chat, to chat chunks), and its usage
counts the whole answer. Greedy answers equal one plain engine's; a sampled one is a valid
sample, but a request's `seed` cannot be honoured across engines and is dropped.

`Progress` sees every event the client is sent. To know the token ids it asks the engines
for them (`return_token_ids`) on requests that can migrate, and strips them from what the
client gets unless the client asked too; so those streams are parsed event by event, where
others are copied as bytes. It forwards whole events only (a client never holds half of
one when its engine fails) and holds back the failed engine's error event.

Requests that cannot be continued this way (`UNSUPPORTED`) are not parsed, and end with an
error event as before: stop strings (the engine holds back text that may begin one, so what
the client has and the tokens sent differ), logprobs, echo, tools and structured output
(their state is not in the tokens), presence and frequency penalties (they count the
answer's tokens, which the continuation sees as prompt), and chat answers split into
reasoning or tool calls by the engine's parsers.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush.proxy.splice import empty_choice, event_json

_EVENT_END = b"\n\n"
_DONE = b"data: [DONE]"
# what a continuation body drops: chat's own fields, the client's stream options (set anew),
# the seed (see above) and what would change the continuation's output shape
_DROPPED = {
    "messages", "prompt", "seed", "max_completion_tokens", "stream_options", "chat_template",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
    "mm_processor_kwargs", "tool_choice", "tools", "parallel_tool_calls", "suffix", "n",
    "add_special_tokens", "return_token_ids", "include_reasoning", "reasoning_effort",
}  # fmt: skip
_OUTPUT_STATE = ("tools", "response_format", "structured_outputs", "guided_json",
                 "guided_regex", "guided_choice", "guided_grammar")  # fmt: skip


def unsupported(body: dict, chat: bool) -> str | None:
    """Why this request's stream cannot be continued on another engine, or None."""
    if not body.get("stream"):
        return "not streamed"
    if body.get("stop"):
        return "stop strings"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs"
    if body.get("echo"):
        return "echo"
    for key in _OUTPUT_STATE:
        value = body.get(key)
        text = key == "response_format" and isinstance(value, dict) and value.get("type") == "text"
        if value and not text:
            return key
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "presence or frequency penalty"
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or options.get("continuous_usage_stats"):
        return "continuous usage stats"  # or options vLLM will refuse
    if (body.get("n") or 1) != 1:
        return "n > 1"
    return None


class Progress:
    """What the client has been sent of one streamed answer, whatever engines it came from."""

    def __init__(self, body: dict, chat: bool) -> None:
        self.chat = chat
        self.strip_ids = not body.get("return_token_ids")  # the client did not ask for them
        prompt = None if chat else body.get("prompt")
        self.prompt_ids: list[int] | None = prompt if isinstance(prompt, list) else None
        self.token_ids: list[int] = []  # the answer's, as sent
        self.head: dict[str, Any] = {}  # the stream's id, object, created and model
        self.finish_reason: str | None = None
        self.usage_sent = self.done = False
        self.error = ""  # the message of an engine's error event, held back
        self.resumable = True  # False once an event shows what cannot be continued
        self._buffer = b""

    def feed(self, data: bytes) -> bytes:
        """What to forward to the client of `data`: its whole events, token ids stripped if
        the client did not ask for them, nothing from an error event on."""
        if self.done or self.error:
            return b""
        self._buffer += data
        out = []
        while not (self.done or self.error) and (end := self._buffer.find(_EVENT_END)) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + len(_EVENT_END) :]
            kept = self._event(event)
            if kept is not None:
                out.append(kept + _EVENT_END)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes | None:
        if event.startswith(_DONE):
            self.done = True
            return event
        obj = event_json(event)
        if obj is None:
            return event
        if "error" in obj:
            error = obj["error"]
            self.error = str(error.get("message") if isinstance(error, dict) else error)
            return None
        for key in ("id", "object", "created", "model"):
            self.head.setdefault(key, obj.get(key))
        if self.prompt_ids is None and isinstance(obj.get("prompt_token_ids"), list):
            self.prompt_ids = obj["prompt_token_ids"]
        self.usage_sent |= bool(obj.get("usage")) and not obj.get("choices")
        for choice in obj.get("choices") or ():
            self._choice(choice)
        if not self.strip_ids:
            return event
        obj.pop("prompt_token_ids", None)
        choices = obj.get("choices") or ()
        only_ids = bool(choices) and not obj.get("usage")
        for choice in choices:
            only_ids &= choice.pop("token_ids", None) is not None
            choice.pop("prompt_token_ids", None)
            only_ids &= empty_choice(choice, self.chat) and "role" not in choice.get("delta", {})
        if only_ids:
            return None  # the engine sent it for its token ids alone
        return b"data: " + msgspec.json.encode(obj)

    def _choice(self, choice: dict) -> None:
        if self.prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
            self.prompt_ids = choice["prompt_token_ids"]
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.token_ids += ids
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            self.resumable = False  # text without its tokens: an engine that did not say them
        delta = choice.get("delta") or {}
        if delta.get("tool_calls") or delta.get("reasoning") or delta.get("reasoning_content"):
            self.resumable = False
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def resumed(self) -> None:
        """The stream goes on from another engine: the failed one's leftovers are dropped."""
        self.error, self._buffer = "", b""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids or ())

    def continuation(self, body: dict) -> dict | None:
        """The plain completion that computes the rest of the answer, or None when there is
        nothing to continue from (no prompt token ids seen)."""
        if self.prompt_ids is None or not self.resumable:
            return None
        out = {k: v for k, v in body.items() if k not in _DROPPED}
        sent = len(self.token_ids)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None:
            out["max_tokens"] = max(1, limit - sent)
        if body.get("min_tokens"):
            out["min_tokens"] = max(0, body["min_tokens"] - sent)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return out | {
            "prompt": self.prompt_ids + self.token_ids,
            "stream": True,
            "stream_options": {"include_usage": include_usage},
            "return_token_ids": True,
        }

    def complete(self, body: dict) -> bool:
        """Every token of the answer was sent: only its end is missing."""
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        return self.finish_reason is not None or (
            limit is not None and len(self.token_ids) >= limit
        )

    def ending(self, body: dict) -> bytes:
        """The events that end a complete answer whose engine failed before it ended it."""
        events: list[dict[str, Any]] = []
        head = self.head | {"object": _OBJECT[self.chat]}
        if self.finish_reason is None:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "stop_reason": None}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            events.append(head | {"choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage") and not self.usage_sent:
            events.append(head | {"choices": [], "usage": self.usage(len(self.token_ids))})
        data = b"".join(b"data: " + msgspec.json.encode(e) + _EVENT_END for e in events)
        return data + _DONE + _EVENT_END

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = self.num_prompt_tokens
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }


_OBJECT = {True: "chat.completion.chunk", False: "text_completion"}


class Rewriter:
    """A continuation's stream (a plain completion) as the rest of the client's: its events
    take the first stream's id, created and model, chat's shape for a chat request, and usage
    counting the whole answer. Feeds `Progress` like `splice.Skip` does: bytes in, bytes out."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.num_sent = len(progress.token_ids)  # before this continuation
        self._buffer = b""

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out = []
        while (end := self._buffer.find(_EVENT_END)) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + len(_EVENT_END) :]
            out.append(self._event(event) + _EVENT_END)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        obj = event_json(event)
        if obj is None or "error" in obj:
            return event
        progress = self.progress
        obj |= {k: v for k, v in progress.head.items() if v is not None}
        obj["object"] = _OBJECT[progress.chat]
        obj.pop("prompt_token_ids", None)
        if isinstance(usage := obj.get("usage"), dict):
            obj["usage"] = progress.usage(self.num_sent + usage.get("completion_tokens", 0))
        obj["choices"] = [self._choice(c) for c in obj.get("choices") or ()]
        return b"data: " + msgspec.json.encode(obj)

    def _choice(self, choice: dict) -> dict:
        choice.pop("prompt_token_ids", None)
        if not self.progress.chat:
            return choice
        out = {
            "index": choice.get("index", 0),
            "delta": {"content": choice.get("text") or ""},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason"),
        }
        if choice.get("finish_reason") is not None:
            out["stop_reason"] = choice.get("stop_reason")
        if choice.get("token_ids") is not None:
            out["token_ids"] = choice["token_ids"]
        return out
