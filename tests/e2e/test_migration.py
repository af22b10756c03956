"""A decode engine killed (SIGKILL) mid-stream: every stream it carried goes on from another
engine (kvpush.proxy.migrate), through the proxy and through the front end, and each client
gets one well-formed stream equal to the plain engine's answer token for token.

This module starts its own engines, since it kills them: a kvpush prefill engine that also
runs the front end, and two decode engines.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace

import pytest

from kvpush.launch.engine import front_end_config
from kvpush.proxy.app import create_app
from kvpush.proxy.config import EngineInfo, ProxyConfig
from tests.e2e.client import body, metric_samples, plain, session, tokens, wait_idle
from tests.e2e.conftest import free_port, pair_specs, start
from tests.servers import run_server

pytestmark = pytest.mark.e2e
NUM_REQUESTS = 8
MAX_TOKENS = 160  # long enough that every stream is mid-answer when the engine dies


@pytest.fixture(scope="module")
def trio(tiny_model, tmp_path_factory):
    prefill, first = pair_specs(str(tiny_model), 32, 32)
    side = free_port()
    second = replace(first, port=free_port(), engine_id=f"decode-b-{side}")
    path = tmp_path_factory.mktemp("front-end") / "front-end.json"
    prefill = front_end_config(prefill, [first.describe(), second.describe()], path, "always")
    engines = start(prefill, first, second)
    trio = dict(zip(("prefill", "first", "second"), engines, strict=True))
    yield trio
    for e in {*engines, *trio.values()}:
        e.stop()


def info(engine) -> EngineInfo:
    return EngineInfo.from_dict(engine.spec.describe())


class Client:
    """One streamed request read event by event; `num_tokens` counts what it has so far."""

    def __init__(self, prompt: list[int], token_ids: bool) -> None:
        self.prompt, self.token_ids = prompt, token_ids
        self.events: list = []
        self.num_tokens = 0

    async def run(self, c, url: str) -> None:
        extra = {"return_token_ids": True} if self.token_ids else {}
        b = body(self.prompt, MAX_TOKENS, stream=True, ignore_eos=True, **extra)
        b["stream_options"] = {"include_usage": True}
        async with c.post(url + "/v1/completions", json=b) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.strip():
                    data = line.strip()[6:]
                    self.events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
                    self.num_tokens += 1

    def check(self, want: dict) -> None:
        """One stream, well-formed, equal to `want` (the plain engine's answer)."""
        evs = self.events
        assert evs and evs[-1] == "[DONE]", evs[-3:]
        assert not any("error" in e for e in evs[:-1]), [e for e in evs if "error" in e]
        choices = [c for e in evs[:-1] for c in e["choices"]]
        assert "".join(c["text"] for c in choices) == want["choices"][0]["text"]
        if self.token_ids:
            got = [t for c in choices for t in c["token_ids"]]
            assert got == want["choices"][0]["token_ids"]
        else:
            assert not any("token_ids" in c or "prompt_token_ids" in c for c in choices)
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        assert len({e["id"] for e in evs[:-1]}) == 1 and len({e["created"] for e in evs[:-1]}) == 1
        usage = evs[-2]["usage"]
        assert (
            usage["prompt_tokens"] == len(self.prompt) and usage["completion_tokens"] == MAX_TOKENS
        )


def kill_mid_stream(url: str, victim, mono_url: str, seed: int) -> list[Client]:
    """NUM_REQUESTS streams to `url`; `victim` SIGKILLed once the first client has a random
    number of tokens; every stream checked against the plain engine."""
    rng = random.Random(seed)
    clients = [
        Client(tokens(rng.randint(40, 300), seed * 100 + i), token_ids=i % 2 == 0)
        for i in range(NUM_REQUESTS)
    ]
    at = rng.randint(2, MAX_TOKENS // 3)

    async def go():
        async with session() as c:
            b = {"ignore_eos": True, "return_token_ids": True}
            wants = [await plain(c, mono_url, k.prompt, MAX_TOKENS, **b) for k in clients]
            tasks = [asyncio.ensure_future(k.run(c, url)) for k in clients]
            # the kill comes once the first stream has `at` tokens: then some streams are
            # mid-answer on the victim, some wait there for their KV, some are not yet sent
            while max(k.num_tokens for k in clients) < at:
                await asyncio.sleep(0.002)
            await asyncio.to_thread(victim.kill)
            await asyncio.gather(*tasks)
        return wants

    wants = asyncio.run(go())
    for k, want in zip(clients, wants, strict=True):
        k.check(want)
    return clients


def moved(metrics: dict[str, float]) -> float:
    """Streams migrated mid-answer, and requests re-sent whole before their first byte: the
    victim's streams, wherever each was when it died."""
    whole = metrics.get('kvpush_proxy_rerouted_total{to="whole"}', 0)
    return metrics.get("kvpush_proxy_migrated_total", 0) + whole


def restart(trio, name: str) -> None:
    """The killed engine again, on its own ports (the front end's configuration names them)."""
    (trio[name],) = start(trio[name].spec)


def test_a_decode_engine_killed_mid_stream_loses_no_stream_through_the_proxy(trio, mono_url):
    config = ProxyConfig(
        engines=tuple(info(trio[k]) for k in ("prefill", "first", "second")),
        disaggregation="always",
        policy="round-robin",  # both decode engines carry streams
    )
    with run_server(create_app(config)) as url:
        kill_mid_stream(url, trio["first"], mono_url, seed=1)
        metrics = metric_samples(url)
    assert moved(metrics) >= 1
    assert metrics['kvpush_proxy_requests_total{mode="push",status="200"}'] == NUM_REQUESTS
    assert not any(k.startswith("kvpush_proxy_streams_failed_total{") for k in metrics)
    wait_idle(trio["second"].spec.url, timeout_s=15)
    restart(trio, "first")


def test_a_decode_engine_killed_mid_stream_loses_no_stream_through_the_front_end(trio, mono_url):
    front = trio["prefill"].spec.url
    kill_mid_stream(front, trio["second"], mono_url, seed=2)
    metrics = metric_samples(front + "/kvpush")
    assert moved(metrics) >= 1
    assert not any(k.startswith("kvpush_proxy_streams_failed_total{") for k in metrics)
    wait_idle(trio["first"].spec.url, timeout_s=15)
    restart(trio, "second")


def test_the_prefill_engine_killed_mid_flight_loses_no_stream(trio, mono_url):
    """The only prefill engine SIGKILLed while streams are at every stage: those past their
    first token decode on; those whose KV was not yet written fail at decode (its liveness)
    and are migrated; those still waiting on prefill are re-sent to decode. Last in this
    module: the front end's engine stays down."""
    config = ProxyConfig(
        engines=tuple(info(trio[k]) for k in ("prefill", "first", "second")),
        disaggregation="always",
    )
    with run_server(create_app(config)) as url:
        kill_mid_stream(url, trio["prefill"], mono_url, seed=3)
        metrics = metric_samples(url)
    assert metrics['kvpush_proxy_requests_total{mode="push",status="200"}'] == NUM_REQUESTS
    assert not any(k.startswith("kvpush_proxy_streams_failed_total{") for k in metrics)
    wait_idle(trio["first"].spec.url, trio["second"].spec.url, timeout_s=30)
