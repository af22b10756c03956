"""Output through prefill+decode equals a plain engine's, token for token."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.e2e.client import disagg, plain, session, text_of, wait_usage_zero

pytestmark = pytest.mark.e2e


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]  # ids 0-2 are special tokens


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("num_tokens", [1, 31, 64, 100, 700, 3000])
@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_plain_engine(pair, mono_url, num_tokens, stream):
    prompt = token_prompt(num_tokens, seed=num_tokens)

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 16, stream=stream)
            got = await disagg(c, pair, prompt, 16, stream=stream)
            return text_of(want), text_of(got)

    want, got = run(go())
    assert got == want
    wait_usage_zero(pair.prefill_url, pair.decode_url, timeout_s=5)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_plain_engine(pair, mono_url, stream):
    prompt = "Return a shallow copy of the list, keeping the order of the items. " * 8

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 16, chat=True, stream=stream)
            got = await disagg(c, pair, prompt, 16, chat=True, stream=stream)
            return text_of(want), text_of(got)

    want, got = run(go())
    assert got == want


@pytest.mark.parametrize("delay", ["prefill-late", "decode-late"])
def test_both_arrival_orders(pair, mono_url, delay):
    prompt = token_prompt(500, seed=7)
    kw = {"delay_prefill_s": 1.0} if delay == "prefill-late" else {"delay_decode_s": 1.0}

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 16)
            got = await disagg(c, pair, prompt, 16, **kw)
            return text_of(want), text_of(got)

    want, got = run(go())
    assert got == want
    wait_usage_zero(pair.prefill_url, pair.decode_url, timeout_s=5)
