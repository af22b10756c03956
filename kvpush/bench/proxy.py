"""`kvpush bench proxy`: what the proxy adds per request, and the requests per second it
sustains, in front of instant fake engines (so only the proxy is measured).

The fake engines are separate processes (`python -m kvpush.bench.proxy PORT`): aiohttp.web
apps that answer at once. Percentiles are numpy's, as `vllm bench serve` computes them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from aiohttp import web

from kvpush import httpclient

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
STREAMED_TOKENS = 64  # events in each streamed answer
STREAM_BODY = BODY | {"max_tokens": STREAMED_TOKENS, "stream": True}


def instant_engine() -> web.Application:
    """An engine that answers at once."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            return await stream(request, body)
        answer = {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1}}
        return web.json_response(answer)

    async def stream(request: web.Request, body: dict) -> web.StreamResponse:
        """One event a token, as vLLM streams them (token ids if asked), then [DONE]."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        ids = body.get("return_token_ids")
        head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny"}
        for i in range(body["max_tokens"]):
            last = i == body["max_tokens"] - 1
            choice = {"index": 0, "text": "x", "finish_reason": "length" if last else None}
            if ids:
                choice |= {"token_ids": [5]} | ({"prompt_token_ids": [1, 2]} if i == 0 else {})
            event = head | {"choices": [choice]}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], url: str) -> subprocess.Popen:
    from kvpush.launch.engine import wait_http

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(url, 30, proc)
    return proc


async def _latencies(url: str, n: int, body: dict = BODY) -> list[float]:
    out = []
    async with httpclient.session() as c:
        for _ in range(n):
            t0 = time.perf_counter()
            async with c.post(url + "/v1/completions", json=body) as r:
                await r.read()
                r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


async def _throughput(url: str, concurrency: int, seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(c) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            async with c.post(url + "/v1/completions", json=BODY) as r:
                await r.read()
                r.raise_for_status()
            done += 1

    async with httpclient.session(concurrency) as c:
        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def main(
    out: Path | None = None,
    requests: int = 300,
    concurrency: int = 32,
    profile: Path | None = None,
) -> int:
    ports = {"prefill": _port(), "decode": _port(), "proxy": _port()}
    procs = []
    try:
        for role in ("prefill", "decode"):
            url = f"http://127.0.0.1:{ports[role]}"
            cmd = [sys.executable, "-m", "kvpush.bench.proxy", str(ports[role])]
            procs.append(_start(cmd, url + "/health"))
        proxy = f"http://127.0.0.1:{ports['proxy']}"
        engines = ["--prefill", f"http://127.0.0.1:{ports['prefill']},engine_id=p0"]
        engines += ["--decode", f"http://127.0.0.1:{ports['decode']}"]
        run = [sys.executable] + (["-m", "cProfile", "-o", str(profile)] if profile else [])
        run += ["-m", "kvpush.cli", "proxy", "--port", str(ports["proxy"]), *engines]
        procs.append(_start(run, proxy + "/health"))
        # the same proxy with migration off: streams relayed as bytes, not event by event
        port = _port()
        bytes_proxy = f"http://127.0.0.1:{port}"
        run = [sys.executable, "-m", "kvpush.cli", "proxy", "--port", str(port), *engines]
        procs.append(_start([*run, "--max-migrations", "0"], bytes_proxy + "/health"))
        direct = f"http://127.0.0.1:{ports['decode']}"
        asyncio.run(_latencies(proxy, 20))  # warm-up
        base = asyncio.run(_latencies(direct, requests))
        via = asyncio.run(_latencies(proxy, requests))
        rps = asyncio.run(_throughput(proxy, concurrency, 5.0))
        streamed = {
            name: float(np.median(asyncio.run(_latencies(url, requests, STREAM_BODY))))
            for name, url in (("direct", direct), ("events", proxy), ("bytes", bytes_proxy))
        }
    finally:
        for p in reversed(procs):  # the proxy first, so a profile is written on its way out
            p.terminate()
            p.wait(timeout=30)
    result = {
        "benchmark": "proxy",
        "requests": requests,
        "concurrency": concurrency,
        "direct_median_ms": float(np.median(base)),
        "direct_p99_ms": float(np.percentile(base, 99)),
        "proxy_median_ms": float(np.median(via)),
        "proxy_p99_ms": float(np.percentile(via, 99)),
        "added_median_ms": float(np.median(via) - np.median(base)),
        "added_p99_ms": float(np.percentile(via, 99) - np.percentile(base, 99)),
        "proxy_requests_per_s": rps,
        # streamed answers of STREAMED_TOKENS events: straight to decode, through the proxy
        # parsing each event (migration on, the default), and relaying bytes (migration off)
        "streamed_tokens": STREAMED_TOKENS,
        "streamed_direct_median_ms": streamed["direct"],
        "streamed_proxy_median_ms": streamed["events"],
        "streamed_proxy_bytes_median_ms": streamed["bytes"],
        "parse_per_event_us": (streamed["events"] - streamed["bytes"]) * 1e3 / STREAMED_TOKENS,
        "upstream": "instant fake engines (prefill and decode, aiohttp.web processes)",
        "profiled": profile is not None,
        "created_unix_s": int(time.time()),
    }
    from kvpush.bench.serve import hardware

    result["hardware"] = hardware()
    print(
        f"direct {result['direct_median_ms']:.2f} ms, through the proxy "
        f"{result['proxy_median_ms']:.2f} ms (both legs): added {result['added_median_ms']:.2f} "
        f"ms median, {result['added_p99_ms']:.2f} ms p99; {rps:.0f} requests/s at "
        f"concurrency {concurrency}; a stream of {STREAMED_TOKENS} events: direct "
        f"{streamed['direct']:.2f} ms, through the proxy {streamed['events']:.2f} ms "
        f"(migration on) and {streamed['bytes']:.2f} ms (off)"
    )
    if profile:
        import pstats

        pstats.Stats(str(profile)).sort_stats("tottime").print_stats(15)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    web.run_app(instant_engine(), host="127.0.0.1", port=int(sys.argv[1]), print=None)
