"""Run an ASGI app on a free local port in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


def stuck_connections(client) -> list[str]:
    """The connections in an httpx client's pool that no request can use again, read when no
    request is in flight: any not idle and not closed (never connected, never sent on, or left
    busy). Read from httpcore's reprs, independently of kvpush.httpclient."""
    reprs = [repr(c) for c in client._transport._pool.connections]
    return [r for r in reprs if ", IDLE, " not in r and ", CLOSED, " not in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_server(app: Any, port: int | None = None) -> Iterator[str]:
    port = port or free_port()
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
