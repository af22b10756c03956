"""Run a server on a free local port in a background thread, for tests: the proxy's
aiohttp.web application (with the proxy's own server settings) or an ASGI app (the fake
engines)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import psutil
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families


def metric_samples(url: str) -> dict[str, float]:
    """A server's /metrics: each sample's name (a counter's with `_total`) to its value summed
    over labels, and each `name{label="value",...}` (labels sorted) to its own value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if sample.labels:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


_GIVEN: set[int] = set()  # ports handed out in this session, maybe not bound yet


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int = 1) -> int:
    """A free local port, with `span` free ports from it up (prefill rank r listens on
    base + r). Chosen below the kernel's ephemeral range and never twice in a session: a
    port the kernel picked for a bind to port 0 can be handed to another process's outgoing
    socket or ZMQ bind before the server it was meant for binds it (vLLM's side channel once
    lost its port that way, and its engine never came up)."""
    high = _ephemeral_low() - span
    for _ in range(200):
        base = random.randrange(10000, high)
        ports = range(base, base + span)
        if not _GIVEN.intersection(ports) and all(_is_free(p) for p in ports):
            _GIVEN.update(ports)
            return base
    raise RuntimeError("no free port range")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def open_connections(pid: int, ports: set[int]) -> list[str]:
    """TCP connections of process `pid` to any of `ports`, as the kernel lists them (not as
    any HTTP client's pool reports them), e.g. 'ESTABLISHED 127.0.0.1:40112 -> :8200'."""
    return [
        f"{c.status} {c.laddr.ip}:{c.laddr.port} -> :{c.raddr.port}"
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port in ports and c.status != psutil.CONN_TIME_WAIT
    ]


@contextlib.contextmanager
def run_server(app: Any, port: int | None = None) -> Iterator[str]:
    port = port or free_port()
    if isinstance(app, web.Application):
        with _run_aiohttp(app, port):
            yield f"http://127.0.0.1:{port}"
        return
    import uvicorn  # here, not at the top: the GPU host runs the transfer tests without it

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def _run_aiohttp(app: web.Application, port: int) -> Iterator[None]:
    from kvpush.proxy.app import runner

    loop = asyncio.new_event_loop()
    r = runner(app)
    loop.run_until_complete(r.setup())
    loop.run_until_complete(web.TCPSite(r, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(timeout=30)
        left = asyncio.run_coroutine_threadsafe(_end_tasks(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    # A task the app left running would die with the loop, and what it held (an upstream
    # response, say) would reach the garbage collector in some later test: fail this one.
    assert not left, f"tasks still running after the server shut down: {left}"


async def _end_tasks() -> list[str]:
    """The tasks other than this one still on the loop, cancelled and waited for."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return [repr(t.get_coro()) for t in tasks]
