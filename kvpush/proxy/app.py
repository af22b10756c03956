"""The P/D proxy's HTTP layer (aiohttp.web): OpenAI-compatible routes over `Dispatcher`.

The server runs with `handler_cancellation`: a client that goes away cancels its handler, which
closes both upstream connections (vLLM aborts both legs) and, with kvpush's connector, ABANDONs
the transfer at prefill. Engines get one pooled aiohttp client each (`EnginePool`), opened at
start-up and closed on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Iterator

import aiohttp
import msgspec
from aiohttp import web

from kvpush.proxy.config import EngineState, ProxyConfig
from kvpush.proxy.dispatch import Dispatcher, route, sse_error
from kvpush.proxy.errors import ProxyError
from kvpush.proxy.legs import (
    DecodeResponse,
    EngineUnreachable,
    LegBroken,
    LegError,
    LegTimeout,
    PrefillLost,
    error_text,
)
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.pool import EnginePool
from kvpush.proxy.relay import relay
from kvpush.proxy.timeline import Trace
from kvpush.transfer.router import Abandoner

log = logging.getLogger(__name__)
POOL = web.AppKey("pool", EnginePool)
METRICS = web.AppKey("metrics", ProxyMetrics)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
_JSON = {"Content-Type": "application/json"}
# How long a complete stream's connection may take to reach its chunked end before it is
# closed instead of reused: vLLM's server writes that end right after [DONE].
REUSE_WAIT_S = 1.0


@contextlib.contextmanager
def transport_errors(engine: EngineState) -> Iterator[None]:
    """aiohttp's client errors as the dispatcher's own (a LegError), naming the engine."""
    try:
        yield
    except aiohttp.ClientError as e:
        where = f"{engine.info.url}: {type(e).__name__}: {e}"
        if isinstance(e, aiohttp.ServerTimeoutError):
            raise LegTimeout(where) from e
        if isinstance(e, aiohttp.ClientConnectorError):
            raise EngineUnreachable(where) from e
        if isinstance(e, aiohttp.ClientConnectionError):
            raise LegBroken(where) from e
        raise LegError(where) from e


class HttpContent:
    """An aiohttp response's body stream, raising the dispatcher's errors."""

    def __init__(self, stream: aiohttp.StreamReader, engine: EngineState) -> None:
        self._stream, self._engine = stream, engine

    def iter_any(self) -> AsyncIterator[bytes]:
        return _Chunks(self._stream.iter_any(), self._engine)

    async def read(self) -> bytes:
        with transport_errors(self._engine):
            return await self._stream.read()


class _Chunks:
    def __init__(self, chunks: AsyncIterator[bytes], engine: EngineState) -> None:
        self._chunks, self._engine = chunks, engine

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        with transport_errors(self._engine):
            return await self._chunks.__anext__()


class HttpDecodeResponse:
    """Decode's aiohttp response as the dispatcher's `DecodeResponse`."""

    def __init__(
        self, response: aiohttp.ClientResponse, engine: EngineState, legs: HttpLegs
    ) -> None:
        self._response, self._engine, self._legs = response, engine, legs
        self.status = response.status
        self._content = HttpContent(response.content, engine)

    @property
    def content(self) -> HttpContent:
        return self._content

    async def read(self) -> bytes:
        with transport_errors(self._engine):
            return await self._response.read()

    def close(self) -> None:
        self._response.close()

    def release(self) -> None:
        """The answer is complete: give the connection back to the pool once the stream's
        chunked end is read. The relay stops at [DONE], which comes a write before that end;
        aiohttp closes a connection released before it, and the next decode leg would pay a
        TCP connect and accept on the engines' cores. An end that does not come within
        REUSE_WAIT_S closes the connection instead (reused, it could carry the rest into the
        next request's answer)."""
        response = self._response

        async def at_end() -> None:
            try:
                async with asyncio.timeout(REUSE_WAIT_S):
                    await response.content.read()
            except BaseException:
                response.close()
                raise
            response.release()

        self._legs.track(asyncio.ensure_future(at_end()))


class HttpLegs:
    """The two legs over each engine's pooled client."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self._background: set[asyncio.Future] = set()  # reads of complete streams' ends

    def track(self, task: asyncio.Future) -> None:
        self._background.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Future) -> None:
        self._background.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            log.debug("a complete stream's connection was closed, not reused: %r", e)

    async def close(self) -> None:
        """At shutdown, before the pool's clients close: end the reads of streams' ends, each
        closing its response, so that none is left to the garbage collector with its
        connection open."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def prefill(self, engine: EngineState, chat: bool, body: dict, headers: dict) -> bytes:
        client = self.pool.client(engine)
        data = msgspec.json.encode(body)
        with transport_errors(engine):
            async with client.post(route(chat), data=data, headers=headers | _JSON) as r:
                answer = await r.read()
                if r.status == 200:
                    return answer
        message = f"prefill engine {engine.info.url}: {error_text(r.status, answer)}"
        if r.status >= 500:
            raise PrefillLost(f"HTTP {r.status}: {message}")
        raise ProxyError(r.status, message)

    async def decode(
        self, engine: EngineState, chat: bool, body: dict, headers: dict
    ) -> DecodeResponse:
        data = msgspec.json.encode(body)
        client = self.pool.client(engine)
        with transport_errors(engine):
            response = await client.post(route(chat), data=data, headers=headers | _JSON)
        return HttpDecodeResponse(response, engine, self)


def create_app(config: ProxyConfig) -> web.Application:
    pool = EnginePool(config)
    metrics = ProxyMetrics()
    abandoner = Abandoner() if config.connector == "kvpush" else None
    legs = HttpLegs(pool)
    dispatcher = Dispatcher(config, pool, legs, metrics, abandoner)

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        await pool.start()
        yield
        await dispatcher.close()
        await legs.close()
        await pool.stop()
        if abandoner is not None:
            abandoner.close()

    async def health(request: web.Request) -> web.Response:
        ok = pool.has_healthy("prefill") and pool.has_healthy("decode")
        return web.json_response({"healthy": ok}, status=200 if ok else 503)

    async def status(request: web.Request) -> web.Response:
        return web.json_response(describe(config, pool))

    async def prom(request: web.Request) -> web.Response:
        metrics.observe_pool(pool)
        return web.Response(
            body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def timelines(request: web.Request) -> web.Response:
        """The phases of the last requests (at most metrics.RECENT_TIMELINES), newest last."""
        return web.json_response({"timelines": list(metrics.recent)})

    async def models(request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "kvpush"} for m in pool.models()]
        return web.json_response({"object": "list", "data": data})

    async def completions(request: web.Request) -> web.StreamResponse:
        return await handle(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await handle(request, chat=True)

    async def handle(request: web.Request, chat: bool) -> web.StreamResponse:
        trace = Trace(request.headers.get("x-request-id"))
        echo = {"X-Request-Id": trace.client_id or trace.request_id}
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"} | echo
        )

        async def start() -> None:
            await response.prepare(request)  # once: later calls return at once

        try:
            body = check_body(await request.read(), pool.models(), config.mode, chat)
            auth = request.headers.get("authorization")
            headers = forward_headers(auth, config) | {"X-Request-Id": trace.request_id}
            answer = await dispatcher.dispatch(body, chat, headers, trace, start)
        except ProxyError as e:
            metrics.requests.labels(config.mode, str(e.status)).inc()
            if not response.prepared:
                return e.response(echo)
            with contextlib.suppress(ConnectionResetError):  # the stream had started
                await response.write(sse_error(e.status, e.message))
                await response.write_eof()
            return response
        except asyncio.CancelledError:
            metrics.requests.labels(config.mode, "499").inc()  # the client went away
            raise
        except ConnectionResetError:  # the client left as its stream started
            metrics.requests.labels(config.mode, "499").inc()
            return response
        metrics.requests.labels(config.mode, "200").inc()
        if answer.body is not None:
            return web.Response(body=answer.body, headers=_JSON | echo)
        with contextlib.suppress(ConnectionResetError):  # the client left mid-stream
            await relay(answer, start, response.write)
            await response.write_eof()
        return response

    app = web.Application()
    app[POOL], app[METRICS], app[DISPATCHER] = pool, metrics, dispatcher
    app.cleanup_ctx.append(lifespan)
    app.router.add_get("/health", health)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", prom)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/timelines", timelines)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


def runner(app: web.Application) -> web.AppRunner:
    """The proxy's server settings, shared by `kvpush proxy` and the tests."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None)


def serve(config: ProxyConfig, host: str, port: int) -> None:
    """Run the proxy until SIGINT/SIGTERM, on uvloop where it is installed."""
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        r = runner(create_app(config))
        await r.setup()
        await web.TCPSite(r, host, port, backlog=1024).start()
        try:
            await stop.wait()
        finally:
            await r.cleanup()  # stop accepting, let handlers finish, close the clients

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def check_body(raw: bytes, models: list[str], mode: str, chat: bool) -> dict:
    body = parse_json(raw)
    if body is None:
        raise ProxyError(400, "request body must be a JSON object")
    check_request(body, models, mode, chat)
    return body


def parse_json(raw: bytes) -> dict | None:
    """The body as a JSON object; None for other JSON; a 400 for what is not JSON."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ProxyError(400, f"request body is not JSON: {e}") from e
    return body if isinstance(body, dict) else None


def check_request(body: dict, models: list[str], mode: str, chat: bool) -> None:
    """A 4xx for a request the proxy cannot serve; fills in `model` when it is missing."""
    model = body.setdefault("model", models[0] if models else None)
    if models and model not in models:
        raise ProxyError(404, f"model {model!r} is not served here; served: {models}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ProxyError(400, f"{name} must be an integer >= 1, got {value!r}")
    if not isinstance(body.get("stream", False), bool):
        raise ProxyError(400, f"stream must be true or false, got {body['stream']!r}")
    if "kv_transfer_params" in body:
        raise ProxyError(400, "kv_transfer_params is set by the proxy; remove it from the request")
    if chat and not isinstance(body.get("messages"), list):
        raise ProxyError(400, "messages must be a list")
    if not chat and not isinstance(body.get("prompt"), str | list):
        raise ProxyError(400, "prompt must be a string or a list of token ids")
    prompt = body.get("prompt")
    if mode == "push" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        raise ProxyError(400, "push mode takes one prompt per request; send each on its own")
    if mode == "push" and body.get("n", 1) != 1:
        raise ProxyError(400, f"n={body.get('n')}: push mode serves n=1 only")


def describe(config: ProxyConfig, pool: EnginePool) -> dict:
    """What /status answers (the front end's /kvpush/status too)."""
    return {
        "mode": config.mode,
        "connector": config.connector,
        "policy": config.policy,
        "first_token": config.early_first_token,
        "engines": [pool.describe(s) for s in pool.states],
    }


def forward_headers(auth: str | None, config: ProxyConfig) -> dict[str, str]:
    """The client's Authorization header for the engines, or the configured API key's."""
    if auth is None and config.api_key:
        auth = f"Bearer {config.api_key}"
    return {"Authorization": auth} if auth else {}
