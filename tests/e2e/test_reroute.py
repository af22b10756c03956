"""A prefill engine killed while streamed requests wait on it: the proxy re-sends each request
(to the other prefill engine, or to decode as a plain request) and every client gets 200 and
the plain engine's text. This module starts its own engines, since it kills them: two prefill
engines with slow chunked prefill (64 tokens a step), so requests queue there, and a decode.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace

import pytest

from kvpush.proxy.app import create_app
from kvpush.proxy.config import EngineInfo, ProxyConfig
from tests.e2e.client import body, metric_samples, plain, post, session, text_of, tokens, wait_idle
from tests.e2e.conftest import free_port, pair_specs, start
from tests.servers import run_server

pytestmark = pytest.mark.e2e
NUM_REQUESTS = 6
PROMPT_TOKENS = 1500  # 6 x 1,500 tokens at 64 a step: about 140 prefill steps, over 0.5 s


@pytest.fixture(scope="module")
def trio(tiny_model):
    first, decode = pair_specs(str(tiny_model), 32, 32)
    slow = ("--max-num-batched-tokens", "64")
    first = replace(first, extra_args=slow)
    side = free_port()
    second = replace(first, port=free_port(), engine_id=f"prefill-b-{side}", side_channel_port=side)
    engines = start(first, second, decode)
    yield engines
    for e in engines:
        e.stop()


def info(engine) -> EngineInfo:
    s = engine.spec
    return EngineInfo.from_dict(s.describe())


def prompts(seed: int) -> list[list[int]]:
    return [tokens(PROMPT_TOKENS, seed * 1000 + i) for i in range(NUM_REQUESTS)]


def kill_while_waiting(victim, prefills, decode, mono_url: str, seed: int) -> dict[str, float]:
    """Send NUM_REQUESTS streamed requests, kill `victim` while they wait on prefill, check
    every answer against the plain engine; the proxy's metrics."""
    config = ProxyConfig(
        engines=tuple(info(e) for e in (*prefills, decode)), disaggregation="always"
    )
    ps = prompts(seed)

    async def go(url: str):
        async with session() as c:
            wants = [text_of(await plain(c, mono_url, p, 8)) for p in ps]
            done = metric_samples(victim.spec.url).get("vllm:request_success_total", 0)
            tasks = [asyncio.ensure_future(post(c, url, body(p, 8, stream=True))) for p in ps]
            await asyncio.to_thread(freeze_once_prefilling, victim, done)
            await asyncio.sleep(0.3)  # every request is in the proxy
            await asyncio.to_thread(victim.kill)
            gots = [text_of(r) for r in await asyncio.gather(*tasks)]
        return wants, gots

    with run_server(create_app(config)) as url:
        wants, gots = asyncio.run(go(url))
        metrics = metric_samples(url)
    assert gots == wants
    wait_idle(decode.spec.url, timeout_s=15)
    return metrics


def freeze_once_prefilling(victim, done: float, timeout_s: float = 30) -> None:
    """SIGSTOP `victim` once it is running one of the requests and has answered none (`done`:
    its finished requests before). A stopped engine answers nothing more, so no request is
    killed between prefill's answer and its KV's WRITE: decode would fail that one, after
    the client had prefill's first token (docs/design/proxy.md, the proxy's re-sends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = metric_samples(victim.spec.url)
        if samples.get("vllm:num_requests_running", 0) >= 1:
            break
        assert time.monotonic() < deadline, f"no request ran on {victim.spec.url}"
        time.sleep(0.005)
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    assert samples.get("vllm:request_success_total", 0) == done, "prefill answered too soon"


def test_only_prefill_killed_decode_computes_every_waiting_request(trio, mono_url):
    first, _, decode = trio
    metrics = kill_while_waiting(first, [first], decode, mono_url, seed=1)
    assert metrics['kvpush_proxy_rerouted_total{to="decode"}'] >= 1
    assert metrics['kvpush_proxy_requests_total{mode="push",status="200"}'] == NUM_REQUESTS


def test_one_of_two_prefill_engines_killed_the_other_takes_its_requests(trio, mono_url):
    _, second, decode = trio
    survivor = replace_engine(trio)
    metrics = kill_while_waiting(second, [second, survivor], decode, mono_url, seed=2)
    assert metrics['kvpush_proxy_rerouted_total{to="prefill"}'] >= 1
    assert metrics.get('kvpush_proxy_rerouted_total{to="decode"}', 0) == 0
    assert metrics['kvpush_proxy_requests_total{mode="push",status="200"}'] == NUM_REQUESTS
    wait_idle(survivor.spec.url, timeout_s=15)


def replace_engine(trio):
    """A live prefill engine besides `second`: the first one again if an earlier test killed
    it (restarted on a new HTTP port, same side channel)."""
    first = trio[0]
    if first.proc.poll() is None:
        return first
    (trio[0],) = start(replace(first.spec, port=free_port()))
    return trio[0]
