"""The front end in a prefill engine's own API server (kvpush.proxy.frontend), on real engines:
a kvpush prefill engine of this module's own, started with the front end as `kvpush serve
--front-end-decode` starts it, in front of the shared decode engine."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from kvpush.launch.engine import EngineSpec, front_end_config
from kvpush.proxy.frontend import OFF_HEADER
from tests.e2e.client import Pair, body, disagg, plain, session, tokens, wait_idle
from tests.e2e.conftest import start
from tests.e2e.test_first_token import stream, streamed_ids, streamed_text
from tests.servers import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def front(engines, tiny_model, tmp_path_factory):
    """The front-end prefill engine; its URL is where clients go."""
    decode = engines["decode"].spec
    side = free_port()
    spec = EngineSpec(
        "prefill",
        str(tiny_model),
        free_port(),
        engine_id=f"prefill-fe-{side}",
        side_channel_port=side,
        connector_extra=decode.connector_extra,  # the same debug checksums as decode's
    )
    path = tmp_path_factory.mktemp("front-end") / "front-end.json"
    (engine,) = start(front_end_config(spec, [decode.describe()], path, "always"))
    yield engine
    engine.stop()


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def last_timeline(url: str) -> dict:
    return get(url + "/kvpush/timelines")["timelines"][-1]


@pytest.mark.parametrize("num_tokens", [31, 1500])
def test_streamed_completion_equals_plain_engine_first_token_from_prefill(
    front, mono_url, num_tokens
):
    url = front.spec.url
    prompt = tokens(num_tokens, seed=70 + num_tokens)

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 16, return_token_ids=True)
            got = await stream(c, url, body(prompt, 16, return_token_ids=True))
            return want, got

    want, events = asyncio.run(go())
    assert streamed_ids(events) == want["choices"][0]["token_ids"]
    assert streamed_text(events) == want["choices"][0]["text"]
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    t = last_timeline(url)
    assert t["status"] == "ok" and t["transfer_id"]
    at = t["events_s"]  # the client's first token was prefill's, before decode's first chunk
    assert at["legs_sent"] <= at["prefill_answer"] <= at["first_token"] < at["first_chunk"]


@pytest.mark.parametrize("chat,streamed", [(False, False), (True, False), (True, True)])
def test_chat_and_unstreamed_answers_equal_plain_engines(front, mono_url, chat, streamed):
    url = front.spec.url
    prompt = "Name the colours of the rainbow in order. " * 4 if chat else tokens(200, seed=3)
    ids = {"return_token_ids": True}

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 12, chat=chat, **ids)
            if streamed:
                return want, await stream(c, url, body(prompt, 12, chat=chat, **ids), chat)
            return want, await plain(c, url, prompt, 12, chat=chat, **ids)

    want, got = asyncio.run(go())
    choice = want["choices"][0]
    if streamed:
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert streamed_ids(got) == choice["token_ids"]
        assert streamed_text(got) == choice["message"]["content"]
    else:
        assert got["choices"][0]["token_ids"] == choice["token_ids"]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 12
    t = last_timeline(url)
    assert t["status"] == "ok" and t["transfer_id"]


def test_a_proxys_leg_and_the_off_header_are_the_engines_own(front, engines, mono_url):
    """The same engine serves behind a proxy (legs with kv_transfer_params) and alone (the
    header), with no front end in either: no timeline is added."""
    url, decode = front.spec.url, engines["decode"].spec.url
    pair = Pair(url, decode, front.spec.name, front.spec.side_channel_port)
    prompt = tokens(120, seed=11)
    before = len(get(url + "/kvpush/timelines")["timelines"])

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 8)
            legs = await disagg(c, pair, prompt, 8)
            headers = {OFF_HEADER.decode(): "off"}
            async with c.post(url + "/v1/completions", json=body(prompt, 8), headers=headers) as r:
                assert r.status == 200
                alone = await r.json()
            return want, legs, alone

    want, legs, alone = asyncio.run(go())
    assert legs["choices"][0]["text"] == alone["choices"][0]["text"] == want["choices"][0]["text"]
    assert len(get(url + "/kvpush/timelines")["timelines"]) == before
    wait_idle(url, decode, timeout_s=10)


@pytest.mark.parametrize(
    "change,status",
    [
        ({"max_tokens": 0}, 400),
        ({"n": 2}, 400),
        ({"model": "not-served"}, 404),
        ({"stream": "yes"}, 400),
    ],
)
def test_bad_requests_get_4xx_and_nothing_is_held(front, engines, change, status):
    url = front.spec.url

    async def go():
        async with (
            session() as c,
            c.post(url + "/v1/completions", json=body([5] * 40, 4) | change) as r,
        ):
            return r.status, await r.json()

    got, answer = asyncio.run(go())
    assert got == status, answer
    assert answer["error"]["code"] == status and answer["error"]["message"]
    wait_idle(url, engines["decode"].spec.url, timeout_s=10)


def test_a_client_that_leaves_mid_stream_frees_both_engines(front, engines):
    url = front.spec.url
    abandoned_before = abandoned(url)

    async def go():
        async with session() as c:
            b = body(tokens(300, seed=21), 400, stream=True) | {"ignore_eos": True}
            async with c.post(url + "/v1/completions", json=b) as r:
                assert r.status == 200
                await r.content.readline()  # the first token, then the client goes away

    asyncio.run(go())
    wait_idle(url, engines["decode"].spec.url, timeout_s=15)
    assert abandoned(url) > abandoned_before
    assert last_timeline(url)["status"] == "ended early"
    assert "Exception in ASGI application" not in front.log_path.read_text()  # a quiet end


def abandoned(url: str) -> float:
    with urllib.request.urlopen(url + "/kvpush/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvpush_proxy_abandoned_total "):
                return float(line.split()[1])
    return 0.0


def test_status_names_this_engine_and_its_decode_engine(front, engines):
    status = get(front.spec.url + "/kvpush/status")
    roles = {e["url"]: (e["role"], e["forces_first_token"]) for e in status["engines"]}
    assert roles == {
        front.spec.url: ("prefill", False),
        engines["decode"].spec.url: ("decode", True),
    }
    assert status["connector"] == "kvpush" and status["first_token"] is True


def test_bench_serve_sweeps_the_front_end_with_its_timeline(
    front, tiny_model, prompt_source, tmp_path
):
    """`kvpush bench serve`'s kvpush-front-end mode: vllm bench serve against the front end,
    and the front end's own timeline phases (its /kvpush/timelines) in each result."""
    from kvpush.bench.serve import sweep
    from kvpush.bench.stacks import FRONT_END

    (path,) = sweep(
        FRONT_END, front.spec.url, [4.0], [64], [4], iterations=1, num_prompts=4,
        results_dir=tmp_path, tokenizer=str(tiny_model), prompts=prompt_source,
        first_iteration=200,
    )  # fmt: skip
    data = json.loads(path.read_text())
    assert path.name == "kvpush-front-end_qps4_in64_out4_iter200.json"
    assert data["completed"] == 4 and data["failed"] == 0 and data["short_outputs"] == 0
    phases = data["proxy_phases_ms"]
    assert {"prefill", "push_tail", "ttft", "total"} <= set(phases), phases
    assert all(p["count"] == 4 for p in phases.values())
