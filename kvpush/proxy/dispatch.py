"""Push and pull dispatch: which engines get a request, in what order, and what happens when a
leg fails. Plain asyncio over two calls (`Legs`, proxy/legs.py, which also runs them), so
tests drive it without HTTP: the legs turn their transport's errors into the dispatcher's own
(`LegError` and its kinds).

Push: pick decode and prefill, mint a transfer_id, send both legs at once, answer from decode.
Pull: prefill first, then decode with the kv_transfer_params prefill returned.

Nothing reaches the client until decode's first chunk (streamed) or its whole answer, so a
prefill engine that fails before then costs the client nothing: the request is re-sent once to
another healthy prefill engine with a new transfer_id (closing the old decode leg makes vLLM
abort it, and kvpush's decode connector cancels its registration), or, with none left, to the
decode engine as a plain request that computes the prompt itself. A 4xx from prefill is the
request's own fault and is returned as it is.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from functools import partial
from typing import Protocol

import msgspec

from kvpush.proxy import paths
from kvpush.proxy.config import EngineState, ProxyConfig
from kvpush.proxy.errors import ProxyError
from kvpush.proxy.legs import (
    Accept,
    Answer,
    Call,
    DecodeLost,
    EngineUnreachable,
    LegBroken,
    LegError,
    LegRunner,
    Legs,
    LegTimeout,
    PrefillLost,
)
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.migrate import Progress, Rewriter, unsupported
from kvpush.proxy.pool import EnginePool
from kvpush.proxy.prefix import block_hashes
from kvpush.proxy.timeline import Trace
from kvpush.transfer.wire import PrefillAddress

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"  # the last event of an OpenAI-style stream
# on a request an engine serves whole: a prefill engine running the front end (frontend.py)
# serves it itself rather than dispatching it again
FRONT_END_OFF = {"X-KVPush-Front-End": "off"}
MAX_PREFILL_TRIES = 2  # the first engine and one other; then decode computes the prompt


class Abandon(Protocol):
    def abandon(self, address: PrefillAddress, transfer_id: str, reason: str) -> None: ...


class Dispatcher:
    def __init__(
        self,
        config: ProxyConfig,
        pool: EnginePool,
        legs: Legs,
        metrics: ProxyMetrics,
        abandoner: Abandon | None = None,
    ) -> None:
        self.config, self.pool, self.legs, self.metrics = config, pool, legs, metrics
        self.abandoner = abandoner
        self.ways = paths.Ways()  # auto's measure of its two ways (kvpush.proxy.paths)
        self.run = LegRunner(pool, legs, metrics, self._ended)
        # tasks that outlive the handler that started them: prefill legs (a streamed answer
        # can end before prefill's does)
        self._background: set[asyncio.Future] = set()

    async def close(self) -> None:
        """At shutdown, before the pool's clients close: end the tasks that still hold an
        upstream response, so that each is closed here and none is left to the garbage
        collector with its connection open."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _track(self, task: asyncio.Future) -> asyncio.Future:
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def dispatch(
        self, body: dict, chat: bool, headers: dict, trace: Trace, accept: Accept | None = None
    ) -> Answer:
        """The answer, or a ProxyError naming what failed (upstream errors mapped to 502/504).

        `accept` (streamed requests): awaited once decode has accepted the request (its 200
        headers), before its first token; the caller sends the client's response headers
        then, so that the first token later leaves in one write. A failure after that must
        reach the client as an error event in the stream (see `sse_error`)."""
        try:
            try:
                tokens, hashes = estimate_prompt_tokens(body, chat), block_hashes(body, chat)
                movable = self.config.max_migrations > 0 and unsupported(body, chat) is None
                progress = Progress(body, chat) if movable else None
                if movable:  # the tokens sent, to continue from (stripped from the client's)
                    body = body | {"return_token_ids": True}
                call = Call(body, chat, headers, trace, tokens, accept, hashes)
                trace.prompt_tokens, trace.streamed = call.tokens, bool(body.get("stream"))
                try:
                    if self.config.mode == "push":
                        answer = await self._push(call)
                    else:
                        answer = await self._pull(call)
                except DecodeLost as e:
                    answer = await self._elsewhere(call, e)
                return self._movable(call, answer, progress)
            except BaseException as e:
                trace.status = f"failed: {type(e).__name__}"
                self.metrics.observe_latency(trace)
                raise
        except (TimeoutError, LegTimeout) as e:
            raise ProxyError(
                504,
                f"an engine did not answer in time ({type(e).__name__}); "
                f"request_timeout_s={self.config.request_timeout_s}",
            ) from e
        except (LegError, PrefillLost) as e:
            raise ProxyError(502, f"upstream engine failed: {type(e).__name__}: {e}") from e

    async def _push(self, call: Call) -> Answer:
        healthy = self.pool.healthy()
        if self.config.connector == "kvpush" and not self.pool.has_healthy("decode") and healthy:
            # no decode engine left: the prefill engines serve requests whole, as plain ones
            engine = paths.plain_engine(healthy, call.tokens, call.hashes)
            self._count(call, paths.Choice("whole", engine))
            return await self._whole(engine, call)
        decode = await self.pool.admit(call.tokens, call.hashes)
        tried: list[EngineState] = []
        while len(tried) < MAX_PREFILL_TRIES:
            # none healthy, or every one at its bound (`EnginePool.has_room`): decode computes
            prefill = self.pool.pick_healthy("prefill", call.tokens, tried, call.hashes)
            if prefill is None:
                break
            if not tried:  # a re-send does not choose again
                roomy = [s for s in healthy if self.pool.has_room(s, 0)]
                choice = self._choose(call, roomy)
                if choice.engine is not None:
                    return await self._whole(choice.engine, call)
            try:
                return await self._push_once(prefill, decode, call)
            except PrefillLost as e:
                tried.append(prefill)
                self._rerouted(call.trace, prefill, e)
        return await self._local(decode, call)

    def _choose(self, call: Call, healthy: list[EngineState]) -> paths.Choice:
        """The prompt's path (kvpush.proxy.paths), counted and in its timeline; `healthy`:
        the engines that may serve it whole. Only kvpush chooses; vLLM's own connectors always
        push."""
        config = self.config
        mode = config.disaggregation if config.connector == "kvpush" else "always"
        return self._count(call, paths.choose(mode, healthy, self.ways, call.tokens, call.hashes))

    def _count(self, call: Call, choice: paths.Choice) -> paths.Choice:
        call.trace.path, call.trace.measured = choice.path, choice.measured
        self.metrics.path.labels(choice.path).inc()
        return choice

    async def _push_once(self, prefill: EngineState, decode: EngineState, call: Call) -> Answer:
        body, chat, trace, tokens = call.body, call.chat, call.trace, call.tokens
        transfer_id = trace.transfer_id = uuid.uuid4().hex
        # prompt tokens queued on prefill before this one (its prefill legs' and whole
        # requests'), and this one's: what prefill computes, less its likely cached prefix
        ahead = paths.queued_tokens(prefill)
        work = paths.uncached(prefill, tokens, call.hashes)
        remember(prefill, call.hashes)
        remember(decode, call.hashes)  # pushed KV is cached there too, where it caches
        info = prefill.info
        p_body = prefill_body(body, chat, {"do_remote_decode": True, "transfer_id": transfer_id})
        d_params = {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_engine_id": info.engine_id,
            "remote_host": info.kv_host,
            "remote_port": info.side_channel_port,
            "tp_size": info.tp_size,
            "pp_size": info.pp_size,
            # vLLM's NixlPushConnector pairs on the id prefill's engine gives the request
            "remote_request_id": f"chatcmpl-{trace.dispatch_id}"
            if chat
            else f"cmpl-{trace.dispatch_id}-0",
        }
        headers = call.leg_headers()
        pool = self.pool
        pool.acquire(prefill, work)
        pool.acquire(decode, tokens, waiting=True)
        trace.mark("legs_sent")
        p_task = self._track(
            asyncio.ensure_future(self.run.prefill(prefill, p_body, chat, headers, trace))
        )

        def prefill_ended(task: asyncio.Future) -> None:
            pool.release(prefill, work)
            pool.prefill_done(decode)
            if not task.cancelled() and task.exception() is not None:
                log.debug("prefill leg %s ended with %r", transfer_id, task.exception())
            elif not task.cancelled() and "prefill_answer" in trace.at:
                seconds = trace.at["prefill_answer"] - trace.at["legs_sent"]
                prefill.rate.observe_prompt(seconds, ahead + work)

        p_task.add_done_callback(prefill_ended)

        def abandon() -> None:
            p_task.cancel()
            if self.abandoner is not None:
                self.metrics.abandoned.inc()
                address = PrefillAddress(info.kv_host, info.side_channel_port, info.tp_size)
                self.abandoner.abandon(address, transfer_id, "request ended")

        return await self.run.answer(
            decode, body | {"kv_transfer_params": d_params}, headers, call,
            p_task, abandon, early=self.first_token_early(decode, body), prefill=prefill,
        )  # fmt: skip

    def first_token_early(self, decode: EngineState, body: dict) -> bool:
        """Whether the client gets prefill's token first: kvpush, streamed, not turned off,
        and a decode engine that declares it forces its first token to prefill's."""
        return (
            self.config.early_first_token
            and decode.info.forces_first_token
            and bool(body.get("stream"))
        )

    async def _pull(self, call: Call) -> Answer:
        body, chat, trace, tokens = call.body, call.chat, call.trace, call.tokens
        tried: list[EngineState] = []
        while len(tried) < MAX_PREFILL_TRIES:
            prefill = self.pool.pick_healthy("prefill", tokens, exclude=tried)
            if prefill is None:
                break
            p_body = prefill_body(body, chat, {"do_remote_decode": True})
            headers = call.leg_headers()
            self.pool.acquire(prefill, tokens)
            trace.mark("legs_sent")
            try:
                p_json = msgspec.json.decode(
                    await self.run.prefill(prefill, p_body, chat, headers, trace)
                )
            except PrefillLost as e:
                tried.append(prefill)
                self._rerouted(trace, prefill, e)
                continue
            finally:
                self.pool.release(prefill, tokens)
            params = p_json.get("kv_transfer_params")
            if not params:
                raise ProxyError(
                    502,
                    f"prefill engine {prefill.info.url} returned no "
                    "kv_transfer_params: is it running NixlConnector?",
                )
            decode = await self.pool.admit(tokens)
            self.pool.acquire(decode, tokens)
            d_body = body | {"kv_transfer_params": params}
            return await self.run.answer(decode, d_body, headers, call)
        return await self._local(await self.pool.admit(tokens), call)

    async def _elsewhere(self, call: Call, lost: DecodeLost) -> Answer:
        """The engine answering the request failed before the client got a byte of it: the
        request, whole, on another healthy engine (once), as a plain one."""
        healthy = self.pool.healthy(but=lost.engine)
        if not healthy or "whole" in call.trace.reroutes:
            raise lost
        if isinstance(lost.error, LegBroken):
            self.pool.mark_failed(lost.engine, lost.error)
        log.warning(
            "request %s: engine %s failed before the client got a byte (%s); serving it whole "
            "on another engine",
            call.trace.request_id,
            lost.engine.info.url,
            lost,
        )
        call.trace.reroutes.append("whole")
        self.metrics.rerouted.labels("whole").inc()
        return await self._whole(paths.plain_engine(healthy, call.tokens, call.hashes), call)

    async def _local(self, decode: EngineState, call: Call) -> Answer:
        """No prefill engine is left, or none has room: decode computes the prompt itself."""
        call.trace.reroutes.append("decode")
        self.metrics.rerouted.labels("decode").inc()
        return await self._whole(decode, call)

    async def _whole(self, engine: EngineState, call: Call) -> Answer:
        """The whole request on one engine, as on one plain engine: a decode engine (the
        `local` path, or no prefill engine left) or a prefill engine (`whole`). A streamed
        one's time to its first chunk is measured into the engine's rate
        (kvpush.proxy.paths). On a prefill engine its prompt counts in the engine's queue
        only until then (`local_tokens`), not in `outstanding_tokens`, which is its prefill
        legs'."""
        trace, tokens = call.trace, call.tokens
        trace.transfer_id = ""
        held = tokens if engine.info.role == "decode" else 0
        ahead = paths.queued_tokens(engine)
        work = paths.uncached(engine, tokens, call.hashes)
        remember(engine, call.hashes)
        engine.local_tokens += work
        self.pool.acquire(engine, held)
        trace.mark("legs_sent")
        try:
            headers = call.leg_headers() | FRONT_END_OFF
            answer = await self.run.answer(engine, call.body, headers, call, held_tokens=held)
        finally:
            engine.local_tokens -= work
        if call.body.get("stream") and "first_chunk" in trace.at:
            seconds = trace.at["first_chunk"] - trace.at["legs_sent"]
            engine.rate.observe_prompt(seconds, ahead + work)
        return answer

    def _movable(self, call: Call, answer: Answer, progress: Progress | None) -> Answer:
        """A stream, with what to do if its engine fails mid-answer (`relay`): continue it on
        another engine where it can (`progress`: the request can be continued)."""
        if answer.stream is not None:
            answer.progress = progress
            answer.resume = partial(self._migrate, call, progress, answer.engine)
        return answer

    async def _migrate(
        self,
        call: Call,
        progress: Progress | None,
        failed: EngineState | None,
        cause: str,
        error: BaseException | None,
    ) -> Answer | None:
        """The rest of a stream whose engine (`failed`) failed mid-answer, from another
        healthy engine (kvpush.proxy.migrate); None, counted, when it cannot go on: the
        request cannot be continued, it has moved `max_migrations` times, or no engine is
        left."""
        answer = None
        if progress is not None:
            answer = await self._continue(call, progress, failed, cause, error)
        if answer is None:
            self.metrics.lost.labels(cause).inc()
        return answer

    async def _continue(
        self,
        call: Call,
        progress: Progress,
        failed: EngineState | None,
        cause: str,
        error: BaseException | None,
    ) -> Answer | None:
        trace = call.trace
        body = progress.continuation(call.body)
        if body is None or len(trace.migrations) >= self.config.max_migrations:
            return None
        if failed is not None and isinstance(error, LegBroken | EngineUnreachable):
            self.pool.mark_failed(failed, error)
        trace.migrations.append(cause)
        trace.measured = False  # not a measure of its path any more (paths.Ways)
        self.metrics.migrated.labels(cause).inc()
        log.warning(
            "request %s: its engine %s failed mid-stream (%s: %s) after %d tokens; "
            "continuing it on another engine",
            trace.request_id,
            failed.info.url if failed is not None else "-",
            cause,
            error or progress.error,
            len(progress.token_ids),
        )
        progress.resumed()
        if progress.complete(call.body):  # only the end was missing
            return Answer(trace, None, progress.ending(call.body), progress=progress)
        healthy = self.pool.healthy(but=failed)
        if not healthy and failed is not None and failed.healthy:
            healthy = [failed]  # it answered with an error but is up: it is all there is
        if not healthy:
            return None
        tokens = len(body["prompt"])
        engine = paths.plain_engine(healthy, tokens, ())
        sub = Call(body, False, call.headers, trace, tokens)
        kept = dict(trace.at)  # the stream's own events: its first token stays its first
        self.pool.acquire(engine, tokens)
        try:
            headers = sub.leg_headers() | FRONT_END_OFF
            answer = await self.run.answer(engine, body, headers, sub)
        except (ProxyError, LegError, TimeoutError) as e:
            return await self._continue(call, progress, engine, "resume", e)
        finally:
            trace.at.update(kept)
        rewriter = Rewriter(progress)
        answer.first, answer.skip = rewriter.feed(answer.first), rewriter
        return self._movable(call, answer, progress)

    def _ended(self, trace: Trace) -> None:
        """A request's answer ended: its timeline, and its TPOT into its path's measure."""
        self.metrics.observe_latency(trace)
        if trace.status == "ok" and trace.measured:
            ttft = trace.at.get("first_token")
            self.ways.observe(trace.path, ttft, trace.tpot_s, trace.num_chunks)

    def _rerouted(self, trace: Trace, prefill: EngineState, error: PrefillLost) -> None:
        log.warning(
            "request %s: prefill engine %s failed before the client got a byte (%s); re-sending",
            trace.request_id,
            prefill.info.url,
            error,
        )
        trace.reroutes.append("prefill")
        self.metrics.rerouted.labels("prefill").inc()


def route(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def prefill_body(body: dict, chat: bool, params: dict) -> dict:
    out = dict(body) | {"max_tokens": 1, "stream": False, "kv_transfer_params": params}
    out.pop("stream_options", None)
    if out.get("min_tokens"):  # prefill's one token honours it, as the first of the answer
        out["min_tokens"] = 1
    if chat or "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def remember(engine: EngineState, hashes: tuple[int, ...]) -> None:
    """The engine computes (or receives) these prompt blocks: its prefix index holds them."""
    if engine.prefix is not None and hashes:
        engine.prefix.add(hashes)


def estimate_prompt_tokens(body: dict, chat: bool) -> int:
    """Token ids count exactly; text is estimated at 4 characters a token."""
    if chat:
        text = "".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        return max(1, len(text) // 4)
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)


def sse_error(status: int, message: str) -> bytes:
    event = {"error": {"message": message, "type": "UpstreamError", "code": status}}
    return b"data: " + msgspec.json.encode(event) + b"\n\ndata: [DONE]\n\n"
