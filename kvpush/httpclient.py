"""HTTP clients for talking to vLLM's API servers.

Two defects of the HTTP stack are worked around here, for every client kvpush opens (the
proxy's pools, the benchmarks, the tests):

- Keep-alive race. vLLM's server closes a keep-alive connection after 5 idle seconds
  (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and httpx keeps one for 5 seconds too: a request sent on a
  socket the server is closing at that moment fails with ReadError or RemoteProtocolError
  although the engine never saw it. Clients here let idle connections go well before the
  server does.
- Orphaned connections (httpcore 1.0.9, encode/httpcore#1093). A request cancelled after the
  pool created a connection for it, but before that connection started to connect, leaves the
  connection in the pool for good: never connected, never idle, never closed. Each one takes a
  slot; once `max_connections` of them pile up, every later request waits forever. A router
  cancels requests all the time (a client goes away, the other leg failed), so `Transport`
  reaps such connections whenever a request ends in an exception.
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


def reap_orphans(pool) -> int:
    """Mark as failed every connection in an httpcore pool that never connected and that no
    request in the pool holds; the pool drops them at its next assignment. Returns how many.
    Reads httpcore's private state; if its shape changes, it does nothing."""
    connections = getattr(pool, "_connections", None)
    requests = getattr(pool, "_requests", None)
    if connections is None or requests is None:
        return 0
    held = {id(r.connection) for r in requests if getattr(r, "connection", None) is not None}
    reaped = 0
    for conn in connections:
        never_connected = getattr(conn, "_connection", False) is None
        if never_connected and conn._connect_failed is False and id(conn) not in held:
            conn._connect_failed = True  # no socket to close: it now reads as closed
            reaped += 1
    return reaped


class Transport(httpx.AsyncHTTPTransport):
    """httpx's transport, but a cancelled or failed request leaves no orphaned connection."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except BaseException:
            pool = self._pool
            if reap_orphans(pool):
                # Hand the freed slots to requests queued behind them now, not at the next
                # request's arrival.
                with pool._optional_thread_lock:
                    closing = pool._assign_requests_to_connections()
                await pool._close_connections(closing)
            raise


def async_client(
    max_connections: int | None = 100, max_keepalive: int | None = None, **kw
) -> httpx.AsyncClient:
    """An httpx.AsyncClient with the limits and the transport above; `kw` as for httpx."""
    keep = max_connections if max_keepalive is None else max_keepalive
    transport = Transport(limits=limits(max_connections, keep))
    return httpx.AsyncClient(transport=transport, **kw)
