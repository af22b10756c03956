"""The few ASGI steps kvpush's middlewares share (vllm/validate.py, proxy/frontend.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

# where a kvpush engine says its scheduler's limits (vllm/validate.py), which the proxy's
# admission reads (proxy/pool.py)
LIMITS_PATH = "/kvpush/limits"


class ClientGone(Exception):
    """The client closed its connection (ASGI's http.disconnect): the request ends quietly."""


async def read_body(receive: Receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def never() -> dict:
    """A `receive` with nothing more to say: waits until cancelled (no disconnect)."""
    await asyncio.Future()
    raise AssertionError("unreachable")


def replay(raw: bytes, then: Receive) -> Receive:
    """A `receive` that gives the body already read, then whatever `then` gives."""
    replayed = False

    async def receive() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await then()

    return receive


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (`name` in lower case), or None."""
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def respond(
    send: Send,
    status: int,
    body: bytes,
    headers: Sequence[tuple[bytes, bytes]] = (),
    content_type: bytes = b"application/json",
) -> None:
    """A whole answer."""
    headers = [(b"content-type", content_type), *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
