"""What one HTTP hop between two Python processes costs on this host, back to back and after
an idle second: a request's send (client, time.perf_counter) -> the server's handler
(time.monotonic; one clock on Linux), and the whole round trip. Two servers, each in its own
process, with the body the benchmarks send (300 token ids): aiohttp.web on uvloop with the
proxy's runner settings, and uvicorn (httptools, uvloop) with FastAPI as vLLM's API server.
Nothing else runs: no engines.

Run on this host: python benchmarks/scripts/idle_hop.py OUT.json
"""

import asyncio
import json
import multiprocessing as mp
import random
import statistics
import sys
import time

from kvpush import httpclient

GAPS = {0.0: 40, 1.0: 10}  # seconds idle before each request: requests


def aiohttp_server(port: int, ready: mp.Queue) -> None:
    import uvloop
    from aiohttp import web

    from kvpush.proxy.app import runner

    async def handler(request: web.Request) -> web.Response:
        t = time.monotonic()
        await request.read()
        return web.json_response({"t": t})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        r = runner(app)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", port).start()
        ready.put(port)
        await asyncio.Event().wait()

    uvloop.run(main())


def uvicorn_server(port: int, ready: mp.Queue) -> None:
    import uvicorn
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.post("/v1/completions")
    async def handler(request: Request) -> dict:
        t = time.monotonic()
        await request.body()
        return {"t": t}

    ready.put(port)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", loop="uvloop")


async def client(servers: dict[str, int]) -> dict:
    rng = random.Random(0)
    out: dict = {}
    async with httpclient.session(max_connections=1) as s:
        for gap, n in GAPS.items():
            for name, port in servers.items():
                hop_in, rtt = [], []
                for _ in range(n):
                    await asyncio.sleep(gap)
                    body = {"model": "tiny", "prompt": [rng.randrange(4096) for _ in range(300)]}
                    t0 = time.perf_counter()
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                        t = (await r.json())["t"]
                    rtt.append((time.perf_counter() - t0) * 1e3)
                    hop_in.append((t - t0) * 1e3)
                out[f"{name}_gap{gap:g}"] = {
                    "hop_in_ms_median": statistics.median(hop_in),
                    "rtt_ms_median": statistics.median(rtt),
                    "requests": n,
                }
                print(name, f"idle {gap:g} s:", out[f"{name}_gap{gap:g}"], flush=True)
    return out


def main(path: str) -> None:
    ready: mp.Queue = mp.Queue()
    servers = {"aiohttp": 9101, "uvicorn": 9102}
    procs = [
        mp.Process(target=aiohttp_server, args=(servers["aiohttp"], ready), daemon=True),
        mp.Process(target=uvicorn_server, args=(servers["uvicorn"], ready), daemon=True),
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)
    time.sleep(3)  # uvicorn binds after it reports
    try:
        out = asyncio.run(client(servers))
    finally:
        for p in procs:
            p.terminate()
    with open(path, "w") as f:
        json.dump({"benchmark": "idle_hop", "rows": out, "created_unix_s": int(time.time())}, f)


if __name__ == "__main__":
    main(sys.argv[1])
