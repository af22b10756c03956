"""HTTP clients for talking to vLLM's API servers.

vLLM's server closes a keep-alive connection after 5 idle seconds (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
and httpx keeps one for 5 seconds too: a request sent on a socket the server is closing at that
moment fails with ReadError or RemoteProtocolError although the engine never saw it. Clients
here let idle connections go well before the server does.
"""

from __future__ import annotations

import httpx

KEEPALIVE_EXPIRY_S = 2.0


def limits(max_connections: int | None = 100, max_keepalive: int | None = 20) -> httpx.Limits:
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )


def async_client(max_connections: int | None = 100, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=limits(max_connections, max_connections), **kw)
