"""kvpush's HTTP client survives the cancellations a router makes all the time.

httpcore 1.0.9 leaves a connection in its pool for good when a request is cancelled after the
pool created the connection for it but before it connected (encode/httpcore#1093), or after it
connected but before it sent (the connection stays NEW); enough of them and every later
request waits forever. These tests produce both and fail with a plain httpx.AsyncClient
(checked by swapping it in): the pool keeps CONNECTING or NEW connections and the last request
times out.
"""

from __future__ import annotations

import asyncio
import random

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvpush.httpclient import async_client
from tests.servers import run_server, stuck_connections


async def _slow(request):
    await asyncio.sleep(random.uniform(0, 0.01))
    return PlainTextResponse("ok")


APP = Starlette(routes=[Route("/", _slow)])


async def _stuck_then_one_more(client, url) -> tuple[list[str], int]:
    """The connections that never connected, then the status of one more request (a pool
    full of them makes it wait forever: bounded here)."""
    stuck = stuck_connections(client)
    r = await asyncio.wait_for(client.get(url), 10)
    return stuck, r.status_code


def test_cancelled_before_connecting_leaves_no_connection_behind():
    with run_server(APP) as url:

        async def go():
            async with async_client(1) as c:
                # Two requests for the one slot; the first gets a new connection and both are
                # cancelled before it connects.
                tasks = [asyncio.create_task(c.get(url)) for _ in range(2)]
                await asyncio.sleep(0)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return await _stuck_then_one_more(c, url)

        stuck, status = asyncio.run(go())
    assert stuck == []
    assert status == 200


def test_random_cancellations_under_contention_keep_every_slot_usable():
    rng = random.Random(1)
    with run_server(APP) as url:

        async def one(c):
            task = asyncio.ensure_future(c.get(url))
            await asyncio.sleep(rng.uniform(0, 0.01))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        async def go():
            async with async_client(4) as c:
                for _ in range(30):
                    await asyncio.gather(*(one(c) for _ in range(16)))
                return await _stuck_then_one_more(c, url)

        stuck, status = asyncio.run(go())
    assert stuck == []
    assert status == 200
