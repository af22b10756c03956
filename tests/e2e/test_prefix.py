"""Decode-side prefix caching with a prefill block of 64 and a decode block of 32: a decode hit
can end mid-way through a prefill block. Only the uncached suffix is written, into the right
slots, and prefill frees its blocks promptly (on a full hit, once the last token is written:
decode continues from prefill's first token, which comes with the WRITE)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.client import (
    disagg,
    kvpush_gauges,
    metric_samples,
    plain,
    session,
    text_of,
    tokens,
    wait_idle,
)
from tests.e2e.conftest import as_pair, pair_specs, start

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rpair(tiny_model):
    # early_source off: every push here starts from the worker's push(), one engine step
    # after vLLM finished the request (the other pairs start theirs from SOURCE).
    # prepare_ahead and layerwise on, as on a GPU (off by default on CPU): every push here
    # is written layer by layer, the last layer by the push (its path is tested here)
    specs = pair_specs(
        str(tiny_model), 64, 32, early_source=False, prepare_ahead=True, layerwise=True
    )
    engines = start(*specs)
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


def test_pushes_are_written_layer_by_layer_while_prefill_computes(rpair, mono_url):
    """Decode registers first (prefill's leg is sent 0.2 s later), so while prefill's
    forward computes the prompt each layer's KV goes to decode as soon as it is computed
    (save_kv_layer), and the push writes only the last layer, with the first token: every
    one of these pushes records the phase "layers_ahead". The answers are a plain engine's
    (prefill's block of 64 against decode's 32: the pieces follow the general copy plan)."""

    def layered() -> float:
        samples = metric_samples(rpair.prefill_url).items()
        name, phase = "kvpush:phase_seconds_count{", 'phase="layers_ahead"'
        return sum(v for k, v in samples if k.startswith(name) and phase in k)

    before = layered()

    async def go():
        async with session() as c:
            for i in range(3):
                prompt = tokens(300, 70 + i)
                want = await plain(c, mono_url, prompt, 8)
                got = await disagg(c, rpair, prompt, 8, delay_prefill_s=0.2)
                assert text_of(got) == text_of(want)

    asyncio.run(go())
    deadline = time.monotonic() + 5  # the engines' stats reach /metrics with a later step
    while layered() < before + 3:
        assert time.monotonic() < deadline, f"{layered() - before} of 3 pushes layer by layer"
        time.sleep(0.1)
    wait_idle(rpair.prefill_url, rpair.decode_url, timeout_s=2)
    # ... and its gauges are on /metrics, back at 0 (wait_idle checks those it finds)
    gauges = kvpush_gauges(rpair.prefill_url)
    assert {"registrations", "layered", "layer_writes_in_flight"} <= gauges.keys(), gauges
