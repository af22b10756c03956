"""A request's legs, and how they run: what the dispatcher (dispatch.py) needs of the HTTP
layer (`Legs`, `DecodeResponse`), the errors the legs raise, one client request on its way
(`Call`) and its answer (`Answer`), and `LegRunner`, which runs a prefill leg and races
decode's leg against prefill's failure up to decode's first chunk. No HTTP library here: the
legs (proxy/app.py, proxy/frontend.py) turn their transport's errors into these.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvpush.proxy.config import EngineState
from kvpush.proxy.errors import ProxyError
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.migrate import Progress
from kvpush.proxy.pool import EnginePool
from kvpush.proxy.splice import Skip, first_token
from kvpush.proxy.timeline import Trace


class Content(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...
    async def read(self) -> bytes: ...


class DecodeResponse(Protocol):
    """What the dispatcher needs of decode's answer (proxy.app.HttpDecodeResponse)."""

    status: int

    @property
    def content(self) -> Content: ...
    async def read(self) -> bytes: ...
    def close(self) -> None: ...  # drops the connection: vLLM aborts the request
    def release(self) -> Any: ...  # the answer is complete: the transport may reuse its link


class Legs(Protocol):
    async def prefill(self, engine: EngineState, chat: bool, body: dict, headers: dict) -> bytes:
        """Prefill's answer (JSON), read only in pull mode; raises PrefillLost or ProxyError."""

    async def decode(
        self, engine: EngineState, chat: bool, body: dict, headers: dict
    ) -> DecodeResponse:
        """Decode's response, once its headers are in."""


Accept = Callable[[], Awaitable[Any]]  # see Dispatcher.dispatch


@dataclass(frozen=True)
class Call:
    """One client request on its way through the dispatcher, whatever legs it takes."""

    body: dict
    chat: bool
    headers: dict  # for both legs; each dispatch adds its own X-Request-Id (leg_headers)
    trace: Trace
    tokens: int  # the prompt's estimated length: the load it puts on an engine
    accept: Accept | None = None  # see Dispatcher.dispatch
    hashes: tuple[int, ...] = ()  # the prompt's blocks (kvpush.proxy.prefix)

    def leg_headers(self) -> dict:
        return self.headers | {"X-Request-Id": self.trace.dispatch_id}


class LegError(Exception):
    """A leg's transport failed: the HTTP layer's errors, as the dispatcher's own."""


class LegTimeout(LegError):
    """The engine did not answer in time."""


class EngineUnreachable(LegError):
    """No connection to the engine could be made: it is down, or not there."""


class LegBroken(LegError):
    """The connection to the engine was lost while the leg ran."""


class DecodeLost(LegError):
    """The engine answering the client (decode's leg, or a whole request's) failed before
    the client got a byte of its answer: the request can be served elsewhere."""

    def __init__(self, engine: EngineState, error: LegError) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.engine, self.error = engine, error


class PrefillLost(Exception):
    """The prefill engine failed (connection lost or refused, or a 5xx) before the client got a
    byte: the request can be sent elsewhere."""


class Filter(Protocol):
    def feed(self, data: bytes) -> bytes: ...


def _no_finish(finished: bool, ended: bool = True) -> None:
    pass


@dataclass
class Answer:
    """Decode's answer: whole (`body`), or a stream whose first chunk is in hand. For a stream,
    `relay` copies the rest and then runs `finish(finished)` exactly once; `finish(False,
    ended=False)` first, if the stream moves to another engine, only closes this one's leg."""

    trace: Trace
    body: bytes | None
    first: bytes = b""
    stream: DecodeResponse | None = None  # None with `first`: prefill's token was the answer
    finish: Callable[..., None] = _no_finish
    # decode's stream less the first token, already in `first` (splice.Skip), or a
    # continuation's as the rest of the client's (migrate.Rewriter)
    skip: Filter | None = None
    engine: EngineState | None = None  # whose stream it is
    progress: Progress | None = None  # what the client has been sent (kvpush.proxy.migrate)
    # the stream continued on another engine after `engine` failed (its cause), or None
    resume: Callable[[str, BaseException | None], Awaitable[Answer | None]] | None = None
    # a pushed stream whose first token came from prefill: set if the prefill engine is
    # taken out of rotation before decode's first chunk (its KV may never come)
    prefill_down: asyncio.Event | None = None


class LegRunner:
    """A request's legs run to an answer: the prefill leg, and decode's leg raced against
    prefill's failure up to decode's first chunk (or whole answer). The dispatcher decides
    which legs a request takes; this runs them, over `legs`, counting them in `pool`."""

    def __init__(
        self,
        pool: EnginePool,
        legs: Legs,
        metrics: ProxyMetrics,
        ended: Callable[[Trace], None] | None = None,
    ) -> None:
        """`ended`: called once with each answer's timeline as it ends (default: recorded in
        `metrics`)."""
        self.pool, self.legs, self.metrics = pool, legs, metrics
        self.ended = ended or metrics.observe_latency

    async def prefill(
        self, prefill: EngineState, p_body: dict, chat: bool, headers: dict, trace: Trace
    ) -> bytes:
        try:
            answer = await self.legs.prefill(prefill, chat, p_body, headers)
        except (EngineUnreachable, LegBroken) as e:
            self.pool.mark_failed(prefill, e)
            raise PrefillLost(f"{type(e).__name__}: {e}") from e
        trace.mark("prefill_answer")
        return answer

    async def answer(
        self,
        decode: EngineState,
        d_body: dict,
        headers: dict,
        call: Call,
        p_task: asyncio.Future | None = None,
        abandon: Callable[[], None] = lambda: None,
        early: bool = False,
        held_tokens: int | None = None,
        prefill: EngineState | None = None,
    ) -> Answer:
        """Decode's headers, then its first chunk or whole answer; a prefill failure before
        that wins, closes decode's leg and is raised.

        `early` (kvpush, streamed): once decode has accepted the request (its headers), the
        first token comes from prefill's answer (proxy.splice), not decode's first chunk.

        No task of its own: the leg runs in the caller's task, and a prefill failure cancels
        that task from a callback (as asyncio.timeout does), told apart from a cancellation by
        the client with `uncancel`.

        `held_tokens`: the prompt tokens `decode`'s count holds for it (pool.acquire; the
        prompt's by default). A streamed answer counts in `decode.decoding` from its first
        token until it ends."""
        chat, trace = call.chat, call.trace
        tokens = call.tokens if held_tokens is None else held_tokens
        me = asyncio.current_task()
        assert me is not None
        hold: list[DecodeResponse] = []
        interrupted: list[BaseException] = []
        racing = True

        def prefill_done(task: asyncio.Future) -> None:
            failure = prefill_failure(task)
            if racing and failure is not None and not interrupted:
                interrupted.append(failure)
                me.cancel()

        try:
            if p_task is not None:
                if (failure := prefill_failure(p_task)) is not None:
                    raise failure
                p_task.add_done_callback(prefill_done)
            try:
                if p_task is not None:
                    # Let the prefill leg reach the wire first: it is on every request's
                    # TTFT, while decode's need only register before prefill finishes.
                    # (Without this yield decode's request, built and sent in this task,
                    # always went out first.) Here, a cancel meanwhile abandons both legs.
                    await asyncio.sleep(0)
                data = await self._decode_leg(decode, d_body, headers, call, hold, not early)
            except asyncio.CancelledError:
                if interrupted and me.uncancel() == 0:
                    raise interrupted[0] from None
                raise
            finally:
                racing = False
                if p_task is not None:
                    p_task.remove_done_callback(prefill_done)
            first = None
            if early:
                assert p_task is not None
                first = first_token(await p_task, d_body, chat)
                if first is None:  # this one is answered from decode's stream whole
                    data = await first_chunk(hold[0], decode)
        except BaseException as e:
            for d_resp in hold:
                d_resp.close()
            abandon()
            self.pool.release(decode, tokens)
            if isinstance(e, EngineUnreachable):
                self.pool.mark_failed(decode, e)
            decode_failed = not (p_task is not None and prefill_failure(p_task) is e)
            if decode_failed and isinstance(e, LegError) and not isinstance(e, LegTimeout):
                raise DecodeLost(decode, e) from e
            raise
        d_resp = hold[0]
        ends = first is not None and first.ends
        streaming = bool(d_body.get("stream")) and not ends
        decode.decoding += streaming
        leg_open = True

        def finish(finished: bool, ended: bool = True) -> None:
            nonlocal leg_open
            if leg_open:
                leg_open = False
                if finished and not ends:
                    d_resp.release()
                else:
                    d_resp.close()
                    abandon()
                self.pool.release(decode, tokens)
                decode.decoding -= streaming
            if not ended:  # the stream goes on from another engine (Dispatcher._migrate)
                return
            trace.status = "ok" if finished else "ended early"
            # prefill's answer can come after decode's: the timeline waits for it
            if p_task is not None and not p_task.done():
                p_task.add_done_callback(lambda _: self.ended(trace))
            else:
                self.ended(trace)

        if first is not None:  # the client's first token is prefill's
            trace.mark("first_token")
            if ends:  # and its last: decode's leg ends here (an ABANDON frees prefill)
                trace.at["last_chunk"] = trace.at["first_token"]
                return Answer(trace, None, first.events, None, finish)
            skip = Skip(first, chat)
            down = prefill.down if prefill is not None else None
            return Answer(
                trace, None, first.events, d_resp, finish, skip, decode, prefill_down=down
            )
        trace.at["first_token"] = trace.mark("first_chunk")
        if not d_body.get("stream"):
            trace.at["last_chunk"] = trace.at["first_chunk"]
            finish(True)
            return Answer(trace, data)
        return Answer(trace, None, data, d_resp, finish, engine=decode)

    async def _decode_leg(
        self,
        decode: EngineState,
        d_body: dict,
        headers: dict,
        call: Call,
        hold: list[DecodeResponse],
        read: bool = True,
    ) -> bytes:
        """Decode's first chunk (streamed) or whole answer, or with `read` False nothing
        beyond its headers; its response goes into `hold`. A streamed request accepted by
        decode is `accept`ed before its first chunk is read."""
        d_resp = await self.legs.decode(decode, call.chat, d_body, headers)
        hold.append(d_resp)
        call.trace.mark("decode_headers")
        if d_resp.status != 200:
            raise decode_error(decode, d_resp.status, await d_resp.read(), call.trace.transfer_id)
        if call.accept is not None and d_body.get("stream"):
            await call.accept()
        if not read:
            return b""
        if not d_body.get("stream"):
            return await d_resp.read()
        return await first_chunk(d_resp, decode)


async def first_chunk(d_resp: DecodeResponse, decode: EngineState) -> bytes:
    try:
        return await d_resp.content.iter_any().__aiter__().__anext__()
    except StopAsyncIteration:
        raise ProxyError(502, f"decode engine {decode.info.url}: empty stream") from None


def prefill_failure(p_task: asyncio.Future) -> BaseException | None:
    if not p_task.done() or p_task.cancelled():
        return None
    return p_task.exception()


def error_text(status: int, data: bytes) -> str:
    try:
        return msgspec.json.decode(data)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return data[:500].decode(errors="replace") or f"HTTP {status}"


def decode_error(decode: EngineState, status: int, data: bytes, transfer_id: str) -> ProxyError:
    if status == 500 and transfer_id:
        return ProxyError(
            502,
            f"KV transfer failed for transfer_id {transfer_id}: decode "
            f"engine {decode.info.url} could not load the KV cache "
            f"({error_text(status, data) or 'HTTP 500'})",
        )
    return ProxyError(status, f"decode engine {decode.info.url}: {error_text(status, data)}")
