"""`kvpush bench proxy`: what the proxy adds per request, and the requests per second it
sustains, in front of instant fake engines (so only the proxy is measured)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi import FastAPI

from kvpush.httpclient import async_client

app = FastAPI()  # an engine that answers at once: `uvicorn kvpush.bench.proxy:app`


@app.get("/health")
async def _health() -> dict:
    return {}


@app.get("/v1/models")
async def _models() -> dict:
    return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}


@app.post("/v1/completions")
async def _completions() -> dict:
    return {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], url: str) -> subprocess.Popen:
    from kvpush.launch.engine import wait_http

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(url, 30, proc)
    return proc


async def _latencies(url: str, n: int) -> list[float]:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    out = []
    async with async_client() as c:
        for _ in range(n):
            t0 = time.perf_counter()
            (await c.post(url + "/v1/completions", json=body)).raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


async def _throughput(url: str, concurrency: int, seconds: float) -> float:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(c: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            (await c.post(url + "/v1/completions", json=body)).raise_for_status()
            done += 1

    async with async_client(concurrency, timeout=30) as c:
        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def main(out: Path | None = None, requests: int = 300, concurrency: int = 32) -> int:
    ports = {"prefill": _port(), "decode": _port(), "proxy": _port()}
    uv = [sys.executable, "-m", "uvicorn", "kvpush.bench.proxy:app", "--log-level", "warning"]
    procs = []
    try:
        for role in ("prefill", "decode"):
            url = f"http://127.0.0.1:{ports[role]}"
            procs.append(_start(uv + ["--port", str(ports[role])], url + "/health"))
        proxy = f"http://127.0.0.1:{ports['proxy']}"
        procs.append(
            _start(
                [
                    sys.executable,
                    "-m",
                    "kvpush.cli",
                    "proxy",
                    "--port",
                    str(ports["proxy"]),
                    "--prefill",
                    f"http://127.0.0.1:{ports['prefill']},engine_id=p0",
                    "--decode",
                    f"http://127.0.0.1:{ports['decode']}",
                ],
                proxy + "/health",
            )
        )
        direct = f"http://127.0.0.1:{ports['decode']}"
        asyncio.run(_latencies(proxy, 20))  # warm-up
        base = asyncio.run(_latencies(direct, requests))
        via = asyncio.run(_latencies(proxy, requests))
        rps = asyncio.run(_throughput(proxy, concurrency, 5.0))
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
    result = {
        "benchmark": "proxy",
        "requests": requests,
        "concurrency": concurrency,
        "direct_median_ms": statistics.median(base),
        "proxy_median_ms": statistics.median(via),
        "added_median_ms": statistics.median(via) - statistics.median(base),
        "proxy_p99_ms": sorted(via)[int(0.99 * (len(via) - 1))],
        "proxy_requests_per_s": rps,
        "upstream": "instant fake engines (prefill and decode)",
        "created_unix_s": int(time.time()),
    }
    from kvpush.bench.serve import hardware

    result["hardware"] = hardware()
    print(
        f"direct {result['direct_median_ms']:.2f} ms, through the proxy "
        f"{result['proxy_median_ms']:.2f} ms (both legs), added {result['added_median_ms']:.2f} "
        f"ms median; {rps:.0f} requests/s at concurrency {concurrency}"
    )
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0
