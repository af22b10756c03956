"""A round-robin front for plain vLLM engines: the `replicas` baseline of `kvpush bench serve`.

DistServe's data-parallel baseline: as many plain engines as the disaggregated stack has, each
on its share of the hardware, requests dealt out in turn. This front relays each request's
bytes to the next engine and the answer's bytes back, streamed, with one pooled client per
engine opened at start-up; a client that goes away closes the engine's connection, so vLLM
aborts the request. It adds one local HTTP hop, as kvpush's proxy does.

    python -m kvpush.bench.roundrobin --port 8000 http://127.0.0.1:8200 http://127.0.0.1:8201
"""

from __future__ import annotations

import argparse
import itertools

import aiohttp
from aiohttp import web

from kvpush import httpclient

# hop-by-hop and length headers: aiohttp sets its own on each side
DROPPED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def build_app(upstream_urls: list[str]) -> web.Application:
    if not upstream_urls:
        raise ValueError("the round-robin front needs at least one engine URL")
    app = web.Application()
    sessions: list[aiohttp.ClientSession] = []
    turn = itertools.count()

    async def open_sessions(_app: web.Application) -> None:
        sessions.extend(httpclient.session(base_url=u.rstrip("/")) for u in upstream_urls)

    async def close_sessions(_app: web.Application) -> None:
        for s in sessions:
            await s.close()

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def relay(request: web.Request) -> web.StreamResponse:
        client = sessions[next(turn) % len(sessions)]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
        body = await request.read()
        async with client.request(
            request.method, request.rel_url.path_qs, data=body, headers=headers
        ) as up:
            out = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() not in DROPPED},
            )
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app.on_startup.append(open_sessions)
    app.on_cleanup.append(close_sessions)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpush.bench.roundrobin")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("engines", nargs="+", help="the plain engines' base URLs")
    args = parser.parse_args(argv)
    web.run_app(build_app(args.engines), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
