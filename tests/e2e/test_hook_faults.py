"""A fault in each connector hook, on the shared real engines: the request fails alone, and
visibly, or goes on; either way both engines end with no KV in use and every kvpush gauge at
0, within seconds rather than at prefill's 30 s lease.

The faults are raised by the connector itself (`debug_faults`, which the shared pair has on),
for a request whose kv_transfer_params name the hook: no real engine fails there on demand.
docs/architecture.md, "When a connector hook fails", says what each failure leaves.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.e2e.client import disagg, metric_samples, plain, session, text_of, wait_idle

pytestmark = pytest.mark.e2e
PROMPT = [11 + (i * 7) % 3000 for i in range(150)]
IDLE_S = 5.0  # well under the 30 s lease: prefill was told, not timed out


def hook_failures(url: str) -> float:
    """kvpush:failures{cause="hook"} on one engine, over its labels."""
    samples = metric_samples(url)
    return sum(v for k, v in samples.items() if k.startswith("kvpush:failures_total{") and
               'cause="hook"' in k)  # fmt: skip


def raised(engine, hook: str) -> int:
    """How often the engine's log says the fault was raised: a test whose fault never fired
    would prove nothing."""
    return engine.log_path.read_text(errors="replace").count(f"kvpush debug fault in {hook}")


def run(pair, leg: str, hook: str, max_tokens: int = 8):
    fault = {"kvpush_debug_fault": hook}
    kv = {"prefill_kv": fault} if leg == "prefill" else {"decode_kv": fault}

    async def go():
        async with session() as c:
            return await disagg(c, pair, PROMPT, max_tokens, **kv)

    return asyncio.run(go())


def reference(mono_url: str, max_tokens: int = 8) -> str:
    async def go():
        async with session() as c:
            return text_of(await plain(c, mono_url, PROMPT, max_tokens))

    return asyncio.run(go())


@pytest.mark.parametrize("hook", ["get_num_new_matched_tokens", "update_state_after_alloc"])
def test_a_decode_hook_that_fails_before_registration_fails_that_request_alone(
    engines, pair, mono_url, hook
):
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=30, step_stale=True)
    before, fired = hook_failures(pair.decode_url), raised(engines["decode"], hook)
    with pytest.raises(aiohttp.ClientResponseError) as failed:
        run(pair, "decode", hook)
    assert failed.value.status == 500  # vLLM's answer to a failed KV load
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=IDLE_S)
    assert raised(engines["decode"], hook) > fired
    assert hook_failures(pair.decode_url) == before + 1
    # the next request is unaffected
    assert text_of(run(pair, "decode", "none")) == reference(mono_url)


def test_prefill_whose_finish_hook_fails_aborts_the_transfer(engines, pair):
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=30, step_stale=True)
    fired = raised(engines["prefill"], "request_finished")
    with pytest.raises(aiohttp.ClientResponseError) as failed:
        run(pair, "prefill", "request_finished")
    assert failed.value.status == 500  # decode was told by prefill's Abort, not by its lease
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=IDLE_S)
    assert raised(engines["prefill"], "request_finished") > fired


@pytest.mark.parametrize(
    ("leg", "hook"),
    [
        ("decode", "request_finished"),
        ("decode", "build_connector_meta"),
        ("decode", "update_connector_output"),
        ("prefill", "build_connector_meta"),
        ("prefill", "update_connector_output"),
    ],
)
def test_a_hook_that_fails_after_the_fact_leaves_the_answer_right(
    engines, pair, mono_url, leg, hook
):
    """build_connector_meta: its actions go with the next step. update_connector_output: the
    finished requests are settled anyway. request_finished on decode after a completed load:
    nothing was held."""
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=30, step_stale=True)
    fired = raised(engines[leg], hook)
    assert text_of(run(pair, leg, hook)) == reference(mono_url)
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=IDLE_S)
    assert raised(engines[leg], hook) > fired


@pytest.mark.parametrize(
    ("leg", "hook"),
    [
        ("decode", "start_load_kv"),
        ("decode", "get_finished"),
        ("prefill", "start_load_kv"),
        ("prefill", "get_finished"),
    ],
)
def test_a_worker_hook_that_fails_ends_the_request_and_frees_its_blocks(
    engines, pair, mono_url, leg, hook
):
    """The worker half's hooks (kvpush.vllm.worker), raised in for one request. On decode
    the load fails (vLLM answers 500): with no readable outcome there is no first token to
    continue from. Prefill's push that cannot start is aborted, and decode told (unless its
    SOURCE already had the KV written: then the answer is right); a push whose result cannot
    be read is reported sent, and the answer is right. Either way nothing stays held."""
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=30, step_stale=True)
    fired = raised(engines[leg], hook)
    try:
        answer = text_of(run(pair, leg, hook))
    except aiohttp.ClientResponseError as e:
        assert e.status == 500 and (leg, hook) != ("prefill", "get_finished"), e
    else:
        assert leg == "prefill" and answer == reference(mono_url)
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=IDLE_S)
    assert raised(engines[leg], hook) > fired
    assert text_of(run(pair, "decode", "none")) == reference(mono_url)  # the next is unaffected
