"""Conditional disaggregation on real engines (kvpush.proxy.paths): a request whose prompt the
decode engine computes itself (`local`), and a burst under `auto` that takes both paths; every
answer equal to one plain engine's (greedy), each path counted."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpush.proxy.app import create_app
from kvpush.proxy.config import EngineInfo, ProxyConfig
from tests.e2e.client import (
    assert_same_or_near_tie,
    body,
    metric_samples,
    plain,
    post,
    session,
    text_of,
    tokens,
    wait_idle,
)
from tests.servers import run_server

pytestmark = pytest.mark.e2e


def infos(engines) -> tuple[EngineInfo, ...]:
    prefill = engines["prefill"].spec
    return (
        EngineInfo(prefill.url, "prefill", prefill.name, "127.0.0.1", prefill.side_channel_port),
        EngineInfo.from_dict(engines["decode"].spec.describe()),
    )


def paths(url: str) -> dict[str, float]:
    samples = metric_samples(url)
    return {p: samples.get(f'kvpush_proxy_path_total{{path="{p}"}}', 0) for p in ("push", "local")}


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_computed_on_decode_answers_as_one_plain_engine(engines, pair, mono_url, stream):
    config = ProxyConfig(engines=infos(engines), disaggregation="never")
    with run_server(create_app(config)) as url:

        async def go():
            async with session() as c:
                p = tokens(400, 71)
                want = await plain(c, mono_url, p, 12, stream=stream)
                got = await post(c, url, body(p, 12, stream=stream))
                return text_of(want), text_of(got)

        want, got = asyncio.run(go())
        assert got == want
        assert paths(url) == {"push": 0, "local": 1}
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=15)


def test_auto_moves_prompts_to_decode_while_prefill_is_queued_and_answers_stay_right(
    engines, pair, mono_url
):
    """One request first (pushed: prefill's time is measured), then a burst of five at once:
    with prompts queued on prefill, decode (idle, the same hardware) is expected faster for
    some; both paths are taken, and every answer is one plain engine's."""
    prompts = [tokens(1500, 80 + i) for i in range(6)]
    with run_server(create_app(ProxyConfig(engines=infos(engines)))) as url:

        async def go():
            async with session() as c:
                wants = [await plain(c, mono_url, p, 8, logprobs=2) for p in prompts]
                first = await post(c, url, body(prompts[0], 8, logprobs=2))
                rest = await asyncio.gather(
                    *(post(c, url, body(p, 8, logprobs=2)) for p in prompts[1:])
                )
                return wants, [first, *rest]

        wants, gots = asyncio.run(go())
        counts = paths(url)
    assert counts["push"] >= 2 and counts["local"] >= 1, counts
    for want, got in zip(wants, gots, strict=True):
        assert_same_or_near_tie(want, got)
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=15)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_served_whole_by_the_prefill_engine_answers_as_one_plain_engine(
    engines, pair, mono_url, stream
):
    """The `whole` path's leg, as the dispatcher sends it (tests/proxy/test_paths.py): the
    client's body unchanged, to the prefill engine (kv_producer), with the header that keeps
    a front end from dispatching it again."""
    from kvpush.proxy.dispatch import FRONT_END_OFF

    async def go():
        async with session() as c:
            p = tokens(400, 91)
            want = await plain(c, mono_url, p, 12, stream=stream)
            async with c.post(
                pair.prefill_url + "/v1/completions",
                json=body(p, 12, stream=stream),
                headers=FRONT_END_OFF,
            ) as r:
                assert r.status == 200
                raw = await r.read()
            return text_of(want), raw

    want, raw = asyncio.run(go())
    if stream:
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")]
        got = "".join(json.loads(e)["choices"][0]["text"] for e in events)
    else:
        got = json.loads(raw)["choices"][0]["text"]
    assert got == want
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=15)
