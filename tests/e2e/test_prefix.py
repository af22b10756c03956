"""Decode-side prefix caching with a prefill block of 64 and a decode block of 32: a decode hit
can end mid-way through a prefill block. Only the uncached suffix is written, into the right
slots, and prefill frees its blocks promptly (on a full hit, once the last token is written:
decode continues from prefill's first token, which comes with the WRITE)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.client import disagg, metric_samples, plain, session, text_of, tokens, wait_idle
from tests.e2e.conftest import as_pair, pair_specs, start

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rpair(tiny_model):
    engines = start(*pair_specs(str(tiny_model), 64, 32))
    yield as_pair(*engines)
    for e in engines:
        e.stop()


def through(pair, mono_url, prompt) -> tuple[str, str, float]:
    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 12)
            got = await disagg(c, pair, prompt, 12)
            return text_of(want), text_of(got), time.monotonic()

    return asyncio.run(go())


def test_no_hit(rpair, mono_url):
    want, got, _ = through(rpair, mono_url, tokens(300, 1))
    assert got == want
    wait_idle(rpair.prefill_url, rpair.decode_url, timeout_s=2)


def prefix_hits(url: str) -> float:
    return metric_samples(url)["vllm:prefix_cache_hits_total"]


def test_hit_ending_mid_prefill_block(rpair, mono_url):
    shared = tokens(40, 2)
    through(rpair, mono_url, shared + tokens(20, 3))  # decode caches tokens 0..31
    hits = prefix_hits(rpair.decode_url)
    want, got, _ = through(rpair, mono_url, shared + tokens(250, 4))  # hit: 32 of 64
    assert prefix_hits(rpair.decode_url) - hits == 32
    assert got == want
    wait_idle(rpair.prefill_url, rpair.decode_url, timeout_s=2)


def test_full_hit_frees_prefill_at_once(rpair, mono_url):
    prompt = tokens(65, 5)  # two whole decode blocks cached, the last token computed
    through(rpair, mono_url, prompt)
    hits = prefix_hits(rpair.decode_url)
    want, got, done = through(rpair, mono_url, prompt)
    assert prefix_hits(rpair.decode_url) - hits == 64
    assert got == want
    took = wait_idle(rpair.prefill_url, rpair.decode_url, timeout_s=2)
    assert took < 2.0
