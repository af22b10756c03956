"""The proxy's push dispatch inside a prefill engine's own API server: the front end.

Through `kvpush proxy` a client's request crosses two more processes than a request sent
straight to an engine: client -> proxy -> prefill's API server, and back the same way. On a
host where a hop to an idle Python process costs about a millisecond, that is most of what
kvpush adds to a plain engine's TTFT (the benchmark log, issue 10:
`git show 1df146f:docs/benchmarks.md`). The front end runs the
same `Dispatcher` as an ASGI middleware in the prefill engine's vLLM API server
(`--middleware kvpush.proxy.frontend.FrontEnd`, which `kvpush serve --front-end-decode`
loads): the client talks to the prefill engine, the prefill leg is an in-process call to
vLLM's own route (no HTTP, no hop), the decode leg goes over HTTP as the proxy sends it, and
prefill's first token goes to the client from the process that has it.

What it takes over: POST /v1/completions and /v1/chat/completions without
`kv_transfer_params`. A request with them (a proxy's leg) or with the header
`X-KVPush-Front-End: off` is the engine's own, as without the front end; so one engine can
serve behind a proxy and as a front end at once. Also served: GET /kvpush/status,
/kvpush/timelines and /kvpush/metrics, as the proxy's /status, /timelines and /metrics.

Its configuration is a proxy configuration file (KVPUSH_FRONT_END_CONFIG, written by `kvpush
serve`) whose one prefill engine is this one; when this engine fails a request, the decode
engine computes the prompt itself, as the proxy does with no prefill engine left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any

import msgspec

from kvpush import logs
from kvpush.asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    never,
    read_body,
    replay,
    respond,
)
from kvpush.proxy.app import HttpLegs, check_request, describe, forward_headers, parse_json
from kvpush.proxy.config import EngineState, ProxyConfig, load_file
from kvpush.proxy.dispatch import FRONT_END_OFF, Dispatcher, route, sse_error
from kvpush.proxy.errors import ProxyError
from kvpush.proxy.legs import PrefillLost, error_text
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.pool import EnginePool
from kvpush.proxy.relay import relay
from kvpush.proxy.timeline import Trace
from kvpush.transfer.router import Abandoner

log = logging.getLogger(__name__)
OFF_HEADER = next(iter(FRONT_END_OFF)).lower().encode()  # "off": served by this engine alone
_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path: chat


def load_config(path: str) -> ProxyConfig:
    data = load_file(path)
    config = ProxyConfig(**data)
    if config.connector != "kvpush":
        raise ValueError(f"{path}: the front end runs kvpush only, got {config.connector!r}")
    if len(config.of_role("prefill")) != 1:
        raise ValueError(f"{path}: name exactly one prefill engine, the front end's own")
    return config


class LocalLegs(HttpLegs):
    """The prefill leg into this process's own app (an ASGI call); decode's over HTTP."""

    def __init__(self, pool: EnginePool, app: Any) -> None:
        super().__init__(pool)
        self.app = app
        self.server: Scope = {}  # what a leg's scope shares with every request (set_server)

    def set_server(self, scope: Scope) -> None:
        """The server's part of a request's scope (the app, its state), once."""
        if not self.server:
            keys = ("type", "asgi", "http_version", "scheme", "server", "root_path", "app")
            self.server = {k: scope[k] for k in keys if k in scope}
            self.server["client"] = ("127.0.0.1", 0)  # the front end itself
            self.server["state"] = scope.get("state", {})

    async def prefill(self, engine: EngineState, chat: bool, body: dict, headers: dict) -> bytes:
        data = msgspec.json.encode(body)
        path = route(chat)
        raw_headers = [(b"content-type", b"application/json")]
        raw_headers += [(b"content-length", str(len(data)).encode())]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        scope = self.server | {
            "state": dict(self.server["state"]),  # per request, as Starlette's is
            "method": "POST",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": raw_headers,
        }
        receive = replay(data, never)  # no disconnect: a cancelled leg is cancelled
        status, chunks = 500, []

        async def send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.app(scope, receive, send)
        except Exception as e:  # vLLM's app raised instead of answering: the engine failed
            raise PrefillLost(f"{type(e).__name__}: {e}") from e
        answer = b"".join(chunks)
        if status == 200:
            return answer
        message = f"prefill engine (this one): {error_text(status, answer)}"
        if status >= 500:
            raise PrefillLost(f"HTTP {status}: {message}")
        raise ProxyError(status, message)


class FrontEnd:
    """ASGI middleware: vLLM instantiates it with the app it wraps."""

    def __init__(self, app: Any, config: ProxyConfig | None = None) -> None:
        self.app = app
        logs.attach()
        if config is None:
            from kvpush.settings import SETTINGS

            if not SETTINGS.front_end_config:
                raise RuntimeError("kvpush front end: set KVPUSH_FRONT_END_CONFIG to its file")
            config = load_config(SETTINGS.front_end_config)
        self.config = config
        self.pool = EnginePool(config)
        self.metrics = ProxyMetrics()
        self.legs = LocalLegs(self.pool, app)
        self.abandoner = Abandoner()
        self.dispatcher = Dispatcher(config, self.pool, self.legs, self.metrics, self.abandoner)
        self._started: asyncio.Task | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._on_lifespan(send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path.startswith("/kvpush/"):
            await self._own_route(path, send)
            return
        if method != "POST" or path not in _ROUTES or header(scope, OFF_HEADER) == "off":
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        try:
            body = parse_json(raw)
        except ProxyError:
            body = None  # vLLM answers malformed JSON itself
        if body is None or "kv_transfer_params" in body:  # a proxy's leg: the engine's own
            await self.app(scope, replay(raw, receive), send)
            return
        self.legs.set_server(scope)
        await self._handle(scope, receive, send, body, _ROUTES[path])

    def _on_lifespan(self, send: Send) -> Send:
        """When the server shuts down: end the dispatcher's tasks, close the pool's clients and
        the ABANDON sockets."""

        async def wrapped(message: dict) -> None:
            if message["type"].startswith("lifespan.shutdown"):
                if self._started is not None:
                    await self.dispatcher.close()
                    await self.legs.close()
                    with contextlib.suppress(Exception):
                        await self.pool.stop()
                self.abandoner.close()
            await send(message)

        return wrapped

    async def _start(self) -> None:
        """The pool starts with the first request: at start-up this server is not up yet."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.pool.start())
        try:
            await asyncio.shield(self._started)
        except RuntimeError as e:  # engines that serve different models: every request says so
            raise ProxyError(503, f"kvpush front end: {e}") from e

    async def _handle(self, scope: Scope, receive: Receive, send: Send, body: dict, chat: bool):
        trace = Trace(header(scope, b"x-request-id"))
        echo = [(b"x-request-id", (trace.client_id or trace.request_id).encode())]
        config = self.config
        stream_headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        started = False

        async def start() -> None:
            nonlocal started
            if not started:
                started = True
                await send(
                    {"type": "http.response.start", "status": 200, "headers": stream_headers + echo}
                )

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async def end() -> None:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await self._start()
            check_request(body, self.pool.models(), config.mode, chat)
            auth = forward_headers(header(scope, b"authorization"), config)
            headers = auth | {"X-Request-Id": trace.request_id}
            answer = await _until_disconnect(
                receive, self.dispatcher.dispatch(body, chat, headers, trace, start)
            )
        except ProxyError as e:
            self.metrics.requests.labels(config.mode, str(e.status)).inc()
            if started:  # the stream had started: the error ends it
                with contextlib.suppress(OSError, ClientGone):
                    await write(sse_error(e.status, e.message))
                    await end()
                return
            extra = [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
            await respond(send, e.status, msgspec.json.encode(e.body()), echo + extra)
            return
        except ClientGone:
            self.metrics.requests.labels(config.mode, "499").inc()
            return
        self.metrics.requests.labels(config.mode, "200").inc()
        if answer.body is not None:
            await respond(send, 200, answer.body, echo)
            return
        with contextlib.suppress(OSError, ClientGone):  # the client left mid-stream
            await _until_disconnect(receive, relay(answer, start, write))
            await end()

    async def _own_route(self, path: str, send: Send) -> None:
        if path == "/kvpush/metrics":
            self.metrics.observe_pool(self.pool)
            await respond(send, 200, self.metrics.render(), [], b"text/plain; version=0.0.4")
            return
        if path == "/kvpush/timelines":
            data: Any = {"timelines": list(self.metrics.recent)}
        elif path == "/kvpush/status":
            data = describe(self.config, self.pool)
        else:
            error = {"message": f"no route {path}", "type": "NotFound", "code": 404}
            await respond(send, 404, msgspec.json.encode({"error": error}), [])
            return
        await respond(send, 200, msgspec.json.encode(data), [])


async def _until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
    """`work`'s result; ClientGone once the client goes away, `work` cancelled first (as the
    proxy's handlers are with aiohttp's handler_cancellation): both legs close, the transfer
    is ABANDONed."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone
    return task.result()
