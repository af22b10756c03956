"""The P/D proxy: OpenAI-compatible routes in front of prefill and decode engines.

Push mode: pick both engines first, mint a transfer_id and a request id, send both legs at
once, stream decode's answer back. Pull mode: prefill first, then decode with the
kv_transfer_params prefill returned. A leg that fails cancels the other; a client that goes
away cancels both (closing an upstream connection makes vLLM abort the request). With kvpush's
connector, a push-mode request that ends without decode's full answer is also ABANDONed at the
prefill engine's ranks: a decode leg aborted before decode's engine saw it cannot cancel, and
prefill would otherwise hold its blocks for the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpush.proxy.config import EngineState, ProxyConfig
from kvpush.proxy.errors import ProxyError
from kvpush.proxy.metrics import ProxyMetrics
from kvpush.proxy.pool import EnginePool
from kvpush.transfer.receiver import PrefillAddress
from kvpush.transfer.router import Abandoner

log = logging.getLogger(__name__)


def create_app(config: ProxyConfig) -> FastAPI:
    pool = EnginePool(config)
    metrics = ProxyMetrics()
    abandoner = Abandoner() if config.connector == "kvpush" else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.stop()
            if abandoner is not None:
                abandoner.close()

    app = FastAPI(title="kvpush proxy", lifespan=lifespan)
    app.state.pool, app.state.metrics = pool, metrics

    @app.get("/health")
    async def health() -> Response:
        ok = pool.has_healthy("prefill") and pool.has_healthy("decode")
        return JSONResponse({"healthy": ok}, 200 if ok else 503)

    @app.get("/status")
    async def status() -> dict:
        return {
            "mode": config.mode,
            "connector": config.connector,
            "policy": config.policy,
            "engines": [pool.describe(s) for s in pool.states],
        }

    @app.get("/metrics")
    async def prom() -> Response:
        metrics.observe_pool(pool)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": m, "object": "model", "owned_by": "kvpush"} for m in pool.models()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    async def handle(request: Request, chat: bool) -> Response:
        trace = Trace(request.headers.get("x-request-id"))
        response = await answer(request, chat, trace)
        response.headers["X-Request-Id"] = trace.client_id or trace.request_id
        return response

    async def answer(request: Request, chat: bool, trace: Trace) -> Response:
        try:
            body = check_body(await request.body(), pool.models(), config.mode, chat)
            headers = forward_headers(request, config) | {"X-Request-Id": trace.request_id}
            dispatch = push if config.mode == "push" else pull
            response = await watch_disconnect(request, dispatch(body, chat, headers, trace))
        except httpx.TimeoutException as e:
            error = ProxyError(
                504,
                f"an engine did not answer in time ({type(e).__name__}); "
                f"request_timeout_s={config.request_timeout_s}",
            )
            metrics.requests.labels(config.mode, "504").inc()
            return error.response()
        except httpx.HTTPError as e:
            pool.mark_failed(str(e.request.url) if e.request else "", e)
            metrics.requests.labels(config.mode, "502").inc()
            return ProxyError(502, f"upstream engine failed: {type(e).__name__}: {e}").response()
        except ProxyError as e:
            metrics.requests.labels(config.mode, str(e.status)).inc()
            return e.response()
        metrics.requests.labels(config.mode, str(response.status_code)).inc()
        return response

    async def push(body: dict, chat: bool, headers: dict, trace: Trace) -> Response:
        tokens = estimate_prompt_tokens(body, chat)
        prefill, decode = pool.pick("prefill", tokens), pool.pick("decode", tokens)
        transfer_id = trace.transfer_id = uuid.uuid4().hex
        request_id = trace.request_id
        p_body = prefill_body(body, chat, {"do_remote_decode": True, "transfer_id": transfer_id})
        info = prefill.info
        d_body = body | {
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "transfer_id": transfer_id,
                "remote_engine_id": info.engine_id,
                "remote_host": info.kv_host,
                "remote_port": info.side_channel_port,
                "tp_size": info.tp_size,
                "pp_size": info.pp_size,
                # vLLM's NixlPushConnector pairs on the id prefill's engine gives the request
                "remote_request_id": f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}-0",
            }
        }
        pool.acquire(prefill, tokens)
        pool.acquire(decode, tokens, waiting=True)
        p_task = asyncio.create_task(timed_prefill(prefill, p_body, chat, headers, trace))
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                pool.release(prefill, tokens)
                pool.release(decode, tokens, waiting=not p_task.done() or p_task.cancelled())

        def abandon() -> None:
            if abandoner is not None:
                metrics.abandoned.inc()
                address = PrefillAddress(info.kv_host, info.side_channel_port, info.tp_size)
                abandoner.abandon(address, transfer_id, "request ended")

        p_task.add_done_callback(lambda _: pool.prefill_done(decode))
        try:
            return await relay_decode(
                decode, d_body, chat, headers, p_task, trace, release, abandon
            )
        except BaseException:
            p_task.cancel()
            abandon()
            release()
            raise

    async def pull(body: dict, chat: bool, headers: dict, trace: Trace) -> Response:
        tokens = estimate_prompt_tokens(body, chat)
        prefill, decode = pool.pick("prefill", tokens), pool.pick("decode", tokens)
        p_body = prefill_body(body, chat, {"do_remote_decode": True})
        pool.acquire(prefill, tokens)
        try:
            p_json = await timed_prefill(prefill, p_body, chat, headers, trace)
        finally:
            pool.release(prefill, tokens)
        params = p_json.get("kv_transfer_params")
        if not params:
            raise ProxyError(
                502,
                f"prefill engine {prefill.info.url} returned no "
                "kv_transfer_params: is it running NixlConnector?",
            )
        pool.acquire(decode, tokens)
        done = asyncio.get_running_loop().create_future()
        done.set_result(p_json)
        return await relay_decode(
            decode,
            body | {"kv_transfer_params": params},
            chat,
            headers,
            done,
            trace,
            lambda: pool.release(decode, tokens),
        )

    async def timed_prefill(
        prefill: EngineState, p_body: dict, chat: bool, headers: dict, trace: Trace
    ) -> dict:
        t0 = time.monotonic()
        r = await pool.client(prefill).post(route(chat), json=p_body, headers=headers)
        trace.prefill_s = time.monotonic() - t0
        metrics.prefill_seconds.observe(trace.prefill_s)
        if r.status_code != 200:
            raise ProxyError(r.status_code, f"prefill engine {prefill.info.url}: {error_text(r)}")
        return r.json()

    async def relay_decode(
        decode: EngineState,
        d_body: dict,
        chat: bool,
        headers: dict,
        p_task: Any,
        trace: Trace,
        release: Any,
        abandon: Callable[[], None] = lambda: None,
    ) -> Response:
        client = pool.client(decode)
        upstream = client.build_request("POST", route(chat), json=d_body, headers=headers)
        d_task = asyncio.create_task(client.send(upstream, stream=True))
        try:
            await first_failure(p_task, d_task)
            d_resp = await d_task
            trace.first_byte_s = time.monotonic() - trace.start
        except BaseException:
            d_task.cancel()
            with contextlib.suppress(BaseException):
                resp = await d_task
                await resp.aclose()
            raise
        if d_resp.status_code != 200:
            await d_resp.aread()
            await d_resp.aclose()
            release()
            raise decode_error(decode, d_resp, trace.transfer_id)
        if not d_body.get("stream"):
            try:
                data = await race(d_resp.aread(), p_task)
                await settle(p_task)
            finally:
                await d_resp.aclose()
                release()
            trace.ttft_s = time.monotonic() - trace.start
            metrics.observe_latency(trace)
            return Response(data, 200, media_type="application/json")
        return relay_stream(d_resp, p_task, trace, release, abandon)

    def relay_stream(
        d_resp: httpx.Response,
        p_task: Any,
        trace: Trace,
        release: Any,
        abandon: Callable[[], None],
    ) -> RelayResponse:
        """Stream decode's answer; `close` runs exactly once, however the stream ends."""
        state: dict[str, Any] = {"finished": False, "closed": False, "reader": None}
        state |= {"first_s": None, "last_s": None, "n": 0}

        async def chunks() -> AsyncIterator[bytes]:
            upstream = d_resp.aiter_raw().__aiter__()
            while True:
                state["reader"] = reader = asyncio.ensure_future(upstream.__anext__())
                try:
                    chunk = await race(reader, p_task)
                except StopAsyncIteration:
                    break
                except ProxyError as e:  # prefill failed while decode waited
                    yield sse_error(e.status, e.message)
                    return
                now = time.monotonic()
                state["first_s"] = state["first_s"] or now
                state["last_s"], state["n"] = now, state["n"] + 1
                yield chunk
            state["finished"] = True

        async def close() -> None:
            # Closing decode's connection makes vLLM abort the request. When the client left
            # mid-stream, prefill's leg is cancelled rather than waited for.
            if state["closed"]:
                return
            state["closed"] = True
            # A read still waiting on decode is not cancelled: httpcore's cleanup of a cancelled
            # read marks the stream closed but can leave the connection busy, and then closing
            # the response does nothing. Closing the response ends the read instead.
            await d_resp.aclose()
            reader = state["reader"]
            if reader is not None:
                await asyncio.wait({reader}, timeout=5)
            if state["finished"]:
                await settle(p_task)
            else:
                p_task.cancel()
                abandon()
            release()
            first_s, last_s, n = state["first_s"], state["last_s"], state["n"]
            if first_s is not None:
                trace.ttft_s = first_s - trace.start
                if n > 1 and last_s:
                    trace.tpot_s = (last_s - first_s) / (n - 1)
                metrics.observe_latency(trace)

        return RelayResponse(chunks(), close)

    return app


@dataclass
class Trace:
    """One client request's ids and timings (seconds from arrival), logged at debug level."""

    client_id: str | None
    request_id: str = field(default_factory=lambda: f"kvpush-{uuid.uuid4().hex}")
    transfer_id: str = ""
    start: float = field(default_factory=time.monotonic)
    prefill_s: float | None = None  # prefill leg, send to answer
    first_byte_s: float | None = None  # decode's response headers
    ttft_s: float | None = None  # first chunk of the answer relayed
    tpot_s: float | None = None  # per streamed chunk after the first

    def log(self) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.1f} ms"

        log.debug(
            "request %s (client id %s, transfer_id %s): prefill leg %s, decode first byte %s, "
            "TTFT %s, TPOT %s",
            self.request_id,
            self.client_id or "-",
            self.transfer_id or "-",
            ms(self.prefill_s),
            ms(self.first_byte_s),
            ms(self.ttft_s),
            ms(self.tpot_s),
        )


class RelayResponse(StreamingResponse):
    """A streamed answer whose upstream is closed the moment the client goes away.

    Starlette's StreamingResponse leaves an abandoned generator to the garbage collector (with
    ASGI 2.4 it notices a disconnect only when a send fails), so decode would run on. Here a
    watcher cancels the stream on `http.disconnect`, and `close` (which closes decode's
    connection) runs shielded from that cancellation before the response returns. It is not
    left to the generator's `finally`: inside a cancelled scope every await there is
    cancelled again, so the upstream would stay open.
    """

    def __init__(self, body: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]):
        super().__init__(body, media_type="text/event-stream")
        self.close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watch(scope_: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            scope_.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                with contextlib.suppress(OSError):  # the client is gone: a send failed
                    await self.stream_response(send)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()


async def settle(p_task: Any) -> None:
    """Decode answered, so prefill is done or about to be: wait for its leg to close."""
    if not p_task.done():
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(p_task), timeout=10)


async def first_failure(p_task: Any, d_task: asyncio.Task) -> None:
    """Wait for decode's response headers; a prefill failure before that wins."""
    while not d_task.done():
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if p_task in done and p_task.exception() is not None:
            raise p_task.exception()
        if p_task in done:
            await d_task
            return


async def race(work: Any, p_task: Any) -> Any:
    """Await `work`, unless the prefill leg fails first.

    If the caller is cancelled, `work` is not: it runs on until the caller closes what it
    reads from (see relay_stream's close), and its outcome is then of no interest."""
    work_task = asyncio.ensure_future(work)
    work_task.add_done_callback(_ignore_outcome)
    if p_task.done() and p_task.exception() is not None:
        work_task.cancel()
        raise p_task.exception()
    waiting = {work_task} if p_task.done() else {work_task, p_task}
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if work_task not in done:
        if p_task.exception() is not None:
            work_task.cancel()
            raise p_task.exception()
        await asyncio.wait({work_task})
    return work_task.result()


def _ignore_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def watch_disconnect(request: Request, work: Any) -> Response:
    """Run the dispatch; if the client goes away first, cancel it (and so both legs)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
    return task.result()


def route(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def check_body(raw: bytes, models: list[str], mode: str, chat: bool) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ProxyError(400, f"request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object")
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
    return body


def prefill_body(body: dict, chat: bool, params: dict) -> dict:
    out = dict(body) | {"max_tokens": 1, "stream": False, "kv_transfer_params": params}
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    if chat or "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def forward_headers(request: Request, config: ProxyConfig) -> dict[str, str]:
    auth = request.headers.get("authorization")
    if auth is None and config.api_key:
        auth = f"Bearer {config.api_key}"
    return {"Authorization": auth} if auth else {}


def estimate_prompt_tokens(body: dict, chat: bool) -> int:
    """Token ids count exactly; text is estimated at 4 characters a token."""
    if chat:
        text = "".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        return max(1, len(text) // 4)
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)


def error_text(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:500] or f"HTTP {r.status_code}"


def decode_error(decode: EngineState, r: httpx.Response, transfer_id: str) -> ProxyError:
    if r.status_code == 500 and transfer_id:
        return ProxyError(
            502,
            f"KV transfer failed for transfer_id {transfer_id}: decode "
            f"engine {decode.info.url} could not load the KV cache "
            f"({error_text(r) or 'HTTP 500'})",
        )
    return ProxyError(r.status_code, f"decode engine {decode.info.url}: {error_text(r)}")


def sse_error(status: int, message: str) -> bytes:
    event = {"error": {"message": message, "type": "UpstreamError", "code": status}}
    return f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
