"""Output through prefill+decode equals a plain engine's, token for token, and decode took
exactly the prompt tokens it should from the transfer (a decode that quietly recomputed the
prompt would give the same text)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from tests.e2e.client import (
    disagg,
    metric_samples,
    plain,
    session,
    text_of,
    tokens,
    wait_usage_zero,
)

pytestmark = pytest.mark.e2e

DECODE_BLOCK = 64  # the shared decode engine's block size (tests/e2e/conftest.py)
_seeds = itertools.count(1000)  # a fresh prompt per case: decode's prefix cache starts cold


def run(coro):
    return asyncio.run(coro)


def counts(decode_url: str) -> tuple[float, float]:
    """Decode's prompt tokens taken from KV transfers (vLLM's own count) and the transfers
    kvpush completed, so far."""
    samples = metric_samples(decode_url)
    key = "vllm:prompt_tokens_by_source_total{"
    external = sum(v for k, v in samples.items() if k.startswith(key) and
                   'source="external_kv_transfer"' in k)  # fmt: skip
    return external, samples.get("kvpush:transfers_total", 0.0)


def moved_since(decode_url: str, before: tuple[float, float]) -> tuple[float, float]:
    """How far `counts` moved since `before`. Both move from the engine loop a moment after
    the answer: wait until the transfer count moved and two reads agree."""
    deadline = time.monotonic() + 5.0
    last = counts(decode_url)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = counts(decode_url)
        if now == last and now[1] != before[1]:
            break
        last = now
    return last[0] - before[0], last[1] - before[1]


def expected_transfers(n: int) -> tuple[int, int]:
    """Prompt tokens decode takes from the transfer on the first and the second send of the
    same n-token prompt, as vLLM counts them.

    - First: all n. Decode recomputes the last position to sample from it, but vLLM counts
      the token as loaded.
    - Second: what decode's prefix cache does not hold. vLLM's cache holds whole blocks and
      never the prompt's last token, so that is the tail after the last whole block before
      the final token.
    - A 1-token prompt: 0. Its KV is written, but once it has arrived vLLM must recompute
      the one position and so sets the request's computed tokens back to 0. The scheduler
      then takes it for a new request and counts the token as computed locally
      (vllm/v1/core/sched/scheduler.py, _update_waiting_for_remote_kv). The transfer still
      happens: decode takes prefill's first token from it (kvpush.vllm.firsttoken).
    """
    if n == 1:
        return 0, 0
    return n, n - (n - 1) // DECODE_BLOCK * DECODE_BLOCK


async def disagg_counted(c, pair, prompt, **kw) -> tuple[dict, tuple[float, float]]:
    """One disaggregated request; its answer and how far decode's counts moved."""
    before = counts(pair.decode_url)
    got = await disagg(c, pair, prompt, 16, **kw)
    return got, moved_since(pair.decode_url, before)


@pytest.mark.parametrize("num_tokens", [1, 2, 31, 64, 100, 700, 3000])
@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_plain_engine(pair, mono_url, num_tokens, stream):
    prompt = tokens(num_tokens, seed=next(_seeds))

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 16, stream=stream)
            moved = []
            for _ in range(2):  # the second send finds the prompt in decode's prefix cache
                got, m = await disagg_counted(c, pair, prompt, stream=stream)
                assert text_of(got) == text_of(want)
                moved.append(m)
            return moved

    moved = run(go())
    assert [n for n, _ in moved] == list(expected_transfers(num_tokens))
    assert [transfers for _, transfers in moved] == [1, 1]
    wait_usage_zero(pair.prefill_url, pair.decode_url, timeout_s=5)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_plain_engine(pair, mono_url, stream):
    prompt = f"Case {next(_seeds)}. " + "Return a shallow copy of the list, in order. " * 8

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 16, chat=True, stream=stream)
            sized = await plain(c, mono_url, prompt, 1, chat=True)  # for its usage
            got, moved = await disagg_counted(c, pair, prompt, chat=True, stream=stream)
            return text_of(want), text_of(got), sized["usage"]["prompt_tokens"], moved

    want, got, num_tokens, moved = run(go())
    assert got == want
    assert moved == (num_tokens, 1)


@pytest.mark.parametrize("delay", ["prefill-late", "decode-late"])
def test_both_arrival_orders(pair, mono_url, delay):
    prompt = tokens(500, seed=next(_seeds))
    kw = {"delay_prefill_s": 1.0} if delay == "prefill-late" else {"delay_decode_s": 1.0}

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 16)
            got, moved = await disagg_counted(c, pair, prompt, **kw)
            return text_of(want), text_of(got), moved

    want, got, moved = run(go())
    assert got == want
    assert moved == (500, 1)
    wait_usage_zero(pair.prefill_url, pair.decode_url, timeout_s=5)
