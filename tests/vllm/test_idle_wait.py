"""Idle steps (kvpush.vllm.worker.PushWorker.wait_idle): on a step that schedules no tokens, a
worker with a transfer in flight waits for it, bounded by idle_wait_s, and wakes as soon as it
completes. The e2e tests run every transfer through it on real engines."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.scheduler import PushScheduler
from kvpush.vllm.worker import PushWorker


def config(idle_wait_s: float, prefill: bool = True) -> ConnectorConfig:
    return ConnectorConfig(
        "p0", prefill, ("UCX",), "127.0.0.1", 5600, 30.0, 5.0, 1.0, False,
        idle_wait_s=idle_wait_s,
    )  # fmt: skip


def test_a_step_that_schedules_no_tokens_is_marked_idle():
    s = PushScheduler(config(0.002), SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=1), cache_config=SimpleNamespace(block_size=16)))  # fmt: skip
    assert s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0)).idle
    assert not s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=7)).idle


def test_the_wait_ends_when_a_transfer_completes_not_at_its_bound():
    worker = PushWorker(config(idle_wait_s=0.05), None)
    worker.config = config(idle_wait_s=30.0)  # past the checked range: only the wake ends it
    future: Future = Future()
    worker._futures["r1"] = future
    threading.Timer(0.05, future.set_result, (None,)).start()
    start = time.monotonic()
    worker.wait_idle()
    assert future.done() and time.monotonic() - start < 20


def test_the_wait_is_bounded_and_skipped_with_nothing_in_flight_or_turned_off():
    worker = PushWorker(config(idle_wait_s=0.01), None)
    worker.wait_idle()  # nothing in flight: returns at once
    worker._futures["r1"] = Future()  # never completes
    worker.wait_idle()  # returns after 10 ms
    worker.config = config(idle_wait_s=0.0)
    worker.wait_idle()
    assert not worker._futures["r1"].done()
