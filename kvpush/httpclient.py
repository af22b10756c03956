"""HTTP clients for talking to vLLM's API servers.

Every client kvpush opens (the proxy's pools, the benchmarks, the tests) comes from
`async_client`. It works around defects of the HTTP stack that a router, which cancels requests
all the time, runs into:

- Keep-alive race. vLLM's server closes a keep-alive connection after 5 idle seconds
  (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and httpx keeps one for 5 seconds too: a request sent on a
  socket the server is closing at that moment fails with ReadError or RemoteProtocolError
  although the engine never saw it. Clients here let idle connections go well before the
  server does.
- httpcore 1.0.9's pool (`Pool` below fixes each, in the pass that hands connections out):
  - It can close a connection it has already handed to a request that has not started on it
    yet (encode/httpcore#1110): as expired, or to make room for another host when the pool is
    full. If the close lands after the request sent, the request fails with
    `ReadError(ClosedResourceError())`: kvpush's own client closed the socket under it.
  - It can hand one idle connection to two waiting requests in one pass.
  - It keeps connections no request holds and none can take (encode/httpcore#1093): one
    created for a request cancelled before it connected, one that connected but was never sent
    on (HTTP/1.1 state NEW), one left busy because a second cancellation cut its cleanup short.
    Each takes a slot for good; once `max_connections` pile up, every request waits.
  - It closes every idle connection once the pool as a whole (not its idle part) exceeds
    `max_keepalive_connections`.
- Interrupted cleanup. httpcore "shields" the close of a response from cancellation with anyio,
  which does not stop asyncio's own `Task.cancel()`: a second cancellation during the close
  leaves the request in the pool's queue for good, holding its connection. `Pool` runs that
  close in a task of its own, which a cancellation of the caller does not stop.
"""

from __future__ import annotations

import asyncio

import httpcore
import httpx

KEEPALIVE_EXPIRY_S = 2.0


def limits(max_connections: int | None = 100, max_keepalive: int | None = 20) -> httpx.Limits:
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )


class _ResponseStream:
    """A response body whose close always finishes: it runs in its own task, so a cancelled
    caller cannot leave the request queued in the pool (see the module's docstring)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._closing: asyncio.Future | None = None

    async def __aiter__(self):
        # The connection's own stream: httpcore's wrapper would run its interruptible close
        # first when the read fails or is cancelled.
        try:
            async for part in getattr(self._inner, "_stream", self._inner):
                yield part
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._inner.aclose())
        await asyncio.shield(self._closing)


class Pool(httpcore.AsyncConnectionPool):
    """httpcore's connection pool with the fixes listed in the module's docstring. Reads
    httpcore's private state (checked by tests/test_httpclient.py); if its shape changes, the
    pool behaves as httpcore's own."""

    _SHAPE = ("_requests", "_connections", "_max_connections", "_max_keepalive_connections")

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        response = await super().handle_async_request(request)
        if hasattr(response.stream, "_pool_request"):
            response.stream = _ResponseStream(response.stream)
        return response

    def _assign_requests_to_connections(self) -> list:
        if not all(hasattr(self, name) for name in self._SHAPE):
            return super()._assign_requests_to_connections()
        # A connection a request holds (waiting to start on it, or using it) is that request's:
        # never closed here, never handed to another.
        held = {id(r.connection) for r in self._requests if r.connection is not None}
        closing = []
        for conn in list(self._connections):
            if conn.is_closed():
                self._connections.remove(conn)
            elif id(conn) in held:
                continue
            elif conn.has_expired() or not conn.is_idle():
                # Expired, or a leftover no request holds and none can take (never connected,
                # never sent on, or busy after an interrupted cleanup).
                self._connections.remove(conn)
                closing.append(conn)
        idle = [c for c in self._connections if c.is_idle() and id(c) not in held]
        keep = self._max_keepalive_connections
        if keep is not None and len(idle) > keep:
            for conn in idle[: len(idle) - keep]:  # the longest in the pool go first
                self._connections.remove(conn)
                closing.append(conn)

        for pool_request in [r for r in self._requests if r.is_queued()]:
            origin = pool_request.request.url.origin
            free = [c for c in self._connections if id(c) not in held and c.is_available()]
            reusable = [c for c in free if c.can_handle_request(origin)]
            if reusable:
                conn = reusable[0]
            else:
                full = self._max_connections is not None
                full = full and len(self._connections) >= self._max_connections
                if full:
                    # Close an idle connection to another host to make room, if there is one.
                    spare = [c for c in free if c.is_idle()]
                    if not spare:
                        continue  # waits for a connection to come free
                    self._connections.remove(spare[0])
                    closing.append(spare[0])
                conn = self.create_connection(origin)
                self._connections.append(conn)
            pool_request.assign_to_connection(conn)
            held.add(id(conn))
        return closing


class Transport(httpx.AsyncHTTPTransport):
    """httpx's transport on `Pool`."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        if type(self._pool) is httpcore.AsyncConnectionPool:
            self._pool.__class__ = Pool


def async_client(
    max_connections: int | None = 100, max_keepalive: int | None = None, **kw
) -> httpx.AsyncClient:
    """An httpx.AsyncClient with the limits and the transport above; `kw` as for httpx."""
    keep = max_connections if max_keepalive is None else max_keepalive
    transport = Transport(limits=limits(max_connections, keep))
    return httpx.AsyncClient(transport=transport, **kw)
