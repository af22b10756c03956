"""A fake vLLM engine, only to inject faults a real engine cannot produce on demand: a hung
upstream, a 400 or 500 on demand (or a 400 that comes late), a 500 in the middle of a stream, a
slow first byte, a stream whose first chunk comes late, a stream that never ends, one whose
chunked end comes a while after its [DONE]. The happy
paths run against real engines (tests/e2e/test_proxy.py)."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def fake_engine(model: str = "tiny", behavior: str = "ok") -> FastAPI:
    app = FastAPI()
    app.state.behavior = behavior
    app.state.requests = []
    app.state.stream_closed = False
    app.state.disconnected = 0  # hung requests whose client closed the connection

    @app.get("/health")
    async def health():
        if app.state.behavior == "down":
            return JSONResponse({}, 503)
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        app.state.headers = dict(request.headers)
        behavior = app.state.behavior
        if behavior == "hang":
            while not await request.is_disconnected():
                await asyncio.sleep(0.05)
            app.state.disconnected += 1
            return JSONResponse({}, 499)
        if behavior == "400-late":  # after the other engine has accepted its leg
            await asyncio.sleep(0.3)
            behavior = "400"
        if behavior in ("500", "400"):
            return JSONResponse({"error": {"message": "boom"}}, int(behavior))
        if behavior == "slow":
            await asyncio.sleep(1.0)
        if not body.get("stream"):
            return {"choices": [{"text": "ok", "index": 0}], "kv_transfer_params": {"x": 1}}

        async def endless():  # until the client goes away
            try:
                while True:
                    yield f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n".encode()
                    await asyncio.sleep(0.05)
            finally:
                app.state.stream_closed = True

        if behavior == "endless":
            return StreamingResponse(endless(), media_type="text/event-stream")

        async def late():  # accepted at once (the headers), its first chunk 2 s later
            try:
                await asyncio.sleep(2.0)
                yield f"data: {json.dumps({'choices': [{'text': 'late'}]})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                app.state.stream_closed = True

        if behavior == "late-first-chunk":
            return StreamingResponse(late(), media_type="text/event-stream")

        async def events():
            for i in range(3):
                if behavior == "500-mid-stream" and i == 1:
                    raise RuntimeError("engine failed mid-stream")
                yield f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            if behavior == "slow-end":  # the chunked end a while after [DONE]
                await asyncio.sleep(0.1)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
