"""Admission under overload, on real engines (kvpush.proxy.pool, `EnginePool.admit`): a burst
far past what the decode engine may hold. Every request ends 200 or 503 with Retry-After
within its wait, the proxy never holds more than the room on decode, each 200 is one plain
engine's answer, and both engines end with no KV block held."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from kvpush.proxy.app import create_app
from kvpush.proxy.config import ProxyConfig
from tests.e2e.client import body, plain, session, text_of, tokens, wait_idle
from tests.e2e.test_paths import infos
from tests.servers import run_server

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 600
ROOM = 2 * PROMPT_TOKENS + 100  # two requests in flight on decode, not three
WAIT_S = 0.5


def decode_held(url: str) -> int:
    with urllib.request.urlopen(url + "/status", timeout=5) as r:
        engines = json.loads(r.read())["engines"]
    return next(e["outstanding_prompt_tokens"] for e in engines if e["role"] == "decode")


def test_a_burst_past_decodes_room_gets_200_or_503_and_leaves_nothing_held(engines, pair, mono_url):
    prompts = [tokens(PROMPT_TOKENS, 300 + i) for i in range(10)]
    config = ProxyConfig(
        engines=infos(engines), disaggregation="always",
        max_decode_prompt_tokens=ROOM, admission_wait_s=WAIT_S,
    )  # fmt: skip
    with run_server(create_app(config)) as url:

        async def one(c, prompt):
            start = time.monotonic()
            async with c.post(url + "/v1/completions", json=body(prompt, 48)) as r:
                data = await r.json()
                return r.status, r.headers.get("Retry-After"), data, time.monotonic() - start

        async def go():
            async with session() as c:
                wants = [await plain(c, mono_url, p, 48) for p in prompts]
                held: list[int] = []
                burst = asyncio.gather(*(one(c, p) for p in prompts))
                while not burst.done():
                    held.append(await asyncio.to_thread(decode_held, url))
                    await asyncio.sleep(0.05)
                return wants, await burst, held

        wants, answers, held = asyncio.run(go())
    statuses = [status for status, _, _, _ in answers]
    assert set(statuses) == {200, 503}, statuses  # some served, some refused: overloaded
    assert max(held) <= ROOM, held
    for want, (status, retry_after, data, seconds) in zip(wants, answers, strict=True):
        if status == 200:
            assert text_of(data) == text_of(want)
        else:
            assert retry_after == "1" and "no decode engine has room" in data["error"]["message"]
            assert seconds < WAIT_S + 5  # refused after its wait, not at a timeout
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=15)
