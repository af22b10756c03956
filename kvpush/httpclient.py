"""HTTP clients for talking to vLLM's API servers, on aiohttp (as vLLM's own P/D proxies are).

Every client kvpush opens (the proxy's per-engine pools, the benchmarks, the tests) comes from
`session`, so they share two settings:

- Keep-alive shorter than the server's, longer than the proxy's health interval. vLLM's server
  closes an idle keep-alive connection after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a request sent
  on a socket the server is closing at that moment fails although the engine never saw it.
  Clients here let idle connections go at 4 s. The proxy checks each engine every 2 s, so one
  connection per engine stays open: a request after an idle spell, and each check, pays no TCP
  connect and accept, on the engine's API server's core.
- Timeouts per read, not per request: a streamed answer may run for minutes, but no single
  read waits longer than `read_timeout_s`.

aiohttp's pool was built for cancellation: a request cancelled at any point closes its
connection (vLLM then aborts the request) and gives the slot back.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

KEEPALIVE_EXPIRY_S = 4.0  # below vLLM's 5 s server-side keep-alive; above health_interval_s


def session(
    max_connections: int = 100,
    read_timeout_s: float | None = 600.0,
    connect_timeout_s: float | None = 5.0,
    base_url: str | None = None,
    on_connect: Callable[[], None] | None = None,
) -> aiohttp.ClientSession:
    """A pooled client; open and close it in the same event loop (`async with`).
    `on_connect` is called for each new TCP connection it opens."""
    connector = aiohttp.TCPConnector(
        limit=max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_EXPIRY_S
    )
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
    )
    traces = []
    if on_connect is not None:
        trace = aiohttp.TraceConfig()

        async def opened(*_: Any) -> None:
            on_connect()

        trace.on_connection_create_end.append(opened)
        traces.append(trace)
    return aiohttp.ClientSession(
        base_url=base_url,
        trace_configs=traces,
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The data of each event of a server-sent-event stream, `[DONE]` included."""
    async for raw in response.content:
        line = raw.strip()
        if line.startswith(b"data: "):
            yield line[6:]


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style server-sent-event stream, up to `data: [DONE]`."""
    async for data in sse_data(response):
        if data == b"[DONE]":
            return
        yield json.loads(data)


def sse_text(event: dict[str, Any]) -> str:
    """The text one event adds: completions' `text` or chat's `delta.content`."""
    out = []
    for choice in event.get("choices", []):
        out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)
