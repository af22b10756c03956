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
  slot; once `max_connections` of them pile up, every later request waits forever. The same
  happens to a connection that did connect when the request is cancelled before it sends:
  httpcore leaves it in its HTTP/1.1 state NEW, which the pool neither reuses nor expires. A
  router cancels requests all the time (a client goes away, the other leg failed), so
  `Transport` drops and closes both kinds whenever a request ends in an exception.
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


def orphans(pool) -> list:
    """The connections in an httpcore pool that no request holds and that no request can ever
    take: never connected, or connected but never sent on (httpcore's HTTP/1.1 state NEW, which
    the pool neither reuses nor expires). Each is a cancelled request's leftover. Reads
    httpcore's private state; if its shape changes, it finds none."""
    connections = getattr(pool, "_connections", None)
    requests = getattr(pool, "_requests", None)
    if connections is None or requests is None:
        return []
    held = {id(r.connection) for r in requests if getattr(r, "connection", None) is not None}
    found = []
    for conn in connections:
        if id(conn) in held or getattr(conn, "_connect_failed", True):
            continue
        inner = getattr(conn, "_connection", False)
        state = getattr(getattr(inner, "_state", None), "name", None)
        if inner is None or state == "NEW":
            found.append(conn)
    return found


class Transport(httpx.AsyncHTTPTransport):
    """httpx's transport, but a cancelled or failed request leaves no orphaned connection."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except BaseException:
            pool = self._pool
            found = orphans(pool)
            if found:
                # Drop them, close their sockets, and hand the freed slots to requests queued
                # behind them now, not at the next request's arrival.
                with pool._optional_thread_lock:
                    for conn in found:
                        pool._connections.remove(conn)
                    closing = pool._assign_requests_to_connections()
                await pool._close_connections(found + closing)
            raise


def async_client(
    max_connections: int | None = 100, max_keepalive: int | None = None, **kw
) -> httpx.AsyncClient:
    """An httpx.AsyncClient with the limits and the transport above; `kw` as for httpx."""
    keep = max_connections if max_keepalive is None else max_keepalive
    transport = Transport(limits=limits(max_connections, keep))
    return httpx.AsyncClient(transport=transport, **kw)
