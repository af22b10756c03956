"""What the scheduler half leaves behind when a connector hook raises (kvpush.vllm.connector):
the request fails alone or goes on, prefill is told at once, and no state stays held.

No engine here: requests are namespaces with the attributes the scheduler reads, and vLLM's
own RequestStatus. tests/e2e/test_hook_faults.py injects the same faults into real engines.
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import zmq
from vllm.v1.request import RequestStatus

from kvpush.transfer import wire
from kvpush.transfer.endpoint import Outcome
from kvpush.transfer.wire import Failure, PrefillAddress
from kvpush.vllm import metadata as m
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.scheduler import PushScheduler
from kvpush.vllm.worker import PushWorker

DECODE_PARAMS = {
    "do_remote_prefill": True,
    "transfer_id": "t1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_engine_id": "p0",
}


def scheduler(
    prefill: bool = False,
    debug_faults: bool = False,
    early_source: bool = False,
    port: int = 5600,
    prepare_ahead: bool = False,
    layerwise: bool = False,
) -> PushScheduler:
    config = ConnectorConfig(
        "p0" if prefill else "d0", prefill, ("UCX",), "127.0.0.1", port, 30.0, 5.0, 1.0,
        False, debug_faults=debug_faults, early_source=early_source,
        prepare_ahead=prepare_ahead, layerwise=layerwise,
    )  # fmt: skip
    return PushScheduler(config, SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=1), cache_config=SimpleNamespace(block_size=16)))  # fmt: skip


def request(params=None, status=RequestStatus.WAITING, rid="r1", output=()):
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        num_prompt_tokens=100,
        status=status,
        output_token_ids=list(output),
    )


def blocks(*ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def output(recving=(), sending=()):
    return SimpleNamespace(finished_recving=set(recving), finished_sending=set(sending))


def actions(s: PushScheduler) -> list:
    return s.build_connector_meta(None).actions


def loading() -> PushScheduler:
    """A decode scheduler whose request r1 registered and waits for its KV."""
    s = scheduler()
    r = request(DECODE_PARAMS)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, blocks(1, 2), 100)
    assert [type(a) for a in actions(s)] == [m.Expect]
    return s


def assert_nothing_held(s: PushScheduler) -> None:
    held = (s._loading, s._loaded, s._refused, s._abandoned, s._sending, s._actions)
    assert not any(held), held
    assert not s.has_pending_push_work()


def test_failed_matching_fails_the_load_and_frees_prefill_at_once():
    s, r = scheduler(), request(DECODE_PARAMS)
    assert s.match_failed(r, 0, RuntimeError("boom")) == (100, True)
    assert s.match_failed(r, 0, RuntimeError("boom")) == (100, True)  # vLLM asks again
    (cancel,) = actions(s)  # one Cancel, not one per call
    assert cancel == m.Cancel(None, cancel.key, cancel.prefill) and cancel.key.transfer_id == "t1"
    s.update_state_after_alloc(r, blocks(1, 2), 100)
    (refuse,) = actions(s)
    assert refuse == m.Refuse("r1", Failure("hook", "matching failed: RuntimeError('boom')"))
    s.update_connector_output(output(recving={"r1"}))  # the worker reports it failed
    s.request_finished(request(DECODE_PARAMS, RequestStatus.FINISHED_ERROR), [1, 2])
    assert_nothing_held(s)


@pytest.mark.parametrize("params", [None, {"do_remote_prefill": "yes"}])
def test_failed_matching_of_a_request_that_is_no_load_computes_it_locally(params):
    s = scheduler()
    assert s.match_failed(request(params), 0, RuntimeError("boom")) == (0, False)
    assert_nothing_held(s)


def test_failed_registration_of_a_claimed_load_fails_it_instead_of_waiting():
    s, r = scheduler(), request(DECODE_PARAMS)
    assert s.get_num_new_matched_tokens(r, 0) == (100, True)
    s.alloc_failed(r, RuntimeError("boom"))
    refuse, cancel = actions(s)
    assert refuse == m.Refuse("r1", Failure("hook", "registration failed: RuntimeError('boom')"))
    assert isinstance(cancel, m.Cancel) and cancel.req_id is None
    s.update_connector_output(output(recving={"r1"}))
    s.request_finished(request(DECODE_PARAMS, RequestStatus.FINISHED_ERROR), [1, 2])
    assert_nothing_held(s)


def test_a_registration_that_went_out_before_the_failure_goes_on():
    s = loading()
    s.alloc_failed(request(DECODE_PARAMS), RuntimeError("late"))
    assert actions(s) == [] and s._loading


def test_failed_finish_on_prefill_aborts_the_transfer_or_keeps_a_queued_push():
    s = scheduler(prefill=True)
    done = request({"do_remote_decode": True, "transfer_id": "t1"}, RequestStatus.FINISHED_STOPPED)
    assert s.finish_failed(done, RuntimeError("boom")) == (False, None)  # vLLM frees the blocks
    (abort,) = actions(s)
    assert isinstance(abort, m.Abort) and abort.key.transfer_id == "t1"
    assert abort.failure.cause == "hook" and "request_finished failed" in abort.failure.reason
    s.request_finished(request(done.kv_transfer_params, done.status, "r2", [7]), [3])
    assert s.finish_failed(request(rid="r2"), RuntimeError("late")) == (True, None)  # queued
    s.update_connector_output(output(sending={"r2"}))
    actions(s)
    assert_nothing_held(s)


def test_failed_finish_on_decode_cancels_a_pending_load_once():
    s = loading()
    aborted = request(DECODE_PARAMS, RequestStatus.FINISHED_ABORTED)
    assert s.finish_failed(aborted, RuntimeError("boom")) == (False, None)
    assert s.finish_failed(aborted, RuntimeError("boom")) == (False, None)
    (cancel,) = actions(s)
    assert cancel.req_id == "r1"
    s.update_connector_output(output(recving={"r1"}))  # prefill acked: vLLM frees the blocks
    assert_nothing_held(s)


def test_settling_an_output_whose_stats_cannot_be_read():
    s = loading()
    s.settle_output(output(recving={"r1"}))
    assert s._loaded == {"r1"} and not s._loading
    s.request_finished(request(DECODE_PARAMS, RequestStatus.FINISHED_STOPPED), [1, 2])
    assert_nothing_held(s)


def test_injected_faults_fire_only_with_debug_faults_and_step_faults_once():
    r = request(DECODE_PARAMS | {"kvpush_debug_fault": "build_connector_meta"})
    scheduler().inject("update_state_after_alloc", r)  # debug_faults off: nothing armed
    s = scheduler(debug_faults=True)
    s.inject("build_connector_meta")  # nothing armed yet
    s.inject("update_state_after_alloc", r)
    with pytest.raises(RuntimeError, match="debug fault in build_connector_meta"):
        s.inject("build_connector_meta")
    s.inject("build_connector_meta")  # once
    r = request(DECODE_PARAMS | {"kvpush_debug_fault": "request_finished"})
    with pytest.raises(RuntimeError, match="debug fault in request_finished for r1"):
        s.inject("request_finished", r)


def test_the_worker_counts_a_hook_failure_by_its_cause():
    worker = PushWorker(scheduler().config, None)
    refusals = [Failure("hook", "registration failed"), Failure("refused", "bad")]
    worker.start([m.Refuse(rid, f) for rid, f in zip(("r1", "r2"), refusals, strict=True)])
    assert worker.results() == (set(), {"r1", "r2"}, {"r1", "r2"})
    assert worker.take_stats().data["failures"] == {"hook": 1, "refused": 1}


def test_a_finished_prefill_announces_its_source_to_its_own_ranks_at_once():
    """The scheduler's SOURCE (early_source) reaches the rank's listener: a real ZMQ socket
    standing in for the endpoint, which tests/transfer/test_push.py runs for real."""
    ctx = zmq.Context()
    listener = ctx.socket(zmq.ROUTER)
    port = listener.bind_to_random_port("tcp://127.0.0.1")
    s = scheduler(prefill=True, early_source=True, port=port)
    try:
        done = request(
            {"do_remote_decode": True, "transfer_id": "t9"}, RequestStatus.FINISHED_STOPPED,
            output=[42],
        )  # fmt: skip
        assert s.request_finished(done, [5, 6])[0]  # vLLM holds the blocks
        (push,) = actions(s)  # the worker still gets the Push, one step later
        assert listener.poll(5000), "no SOURCE within 5 s"
        env = wire.decode_envelope(listener.recv_multipart()[-1])
        assert env.reply_to == ""  # nothing to answer
        assert env.msg == wire.SourceMsg(push.key, [5, 6], 100, 42)
    finally:
        s.close()
        listener.close()
        ctx.term()


PREFILL_PARAMS = {"do_remote_decode": True, "transfer_id": "t7"}


def test_a_prefill_leg_scheduled_with_its_whole_prompts_blocks_is_prepared():
    s = scheduler(prefill=True, prepare_ahead=True)
    s.update_state_after_alloc(request(PREFILL_PARAMS), blocks(*range(7)), 0)  # 7 x 16 >= 100
    (prepare,) = actions(s)
    assert prepare == m.Prepare(wire.TransferKey("t7"), list(range(7)), 100)
    assert_nothing_held(s)  # only a head start: nothing waits on it


def test_a_prefill_leg_written_layer_by_layer_is_prepared_so():
    s = scheduler(prefill=True, layerwise=True)  # prepare_ahead off, as on CPU
    s.update_state_after_alloc(request(PREFILL_PARAMS), blocks(*range(7)), 0)
    (prepare,) = actions(s)
    assert prepare == m.Prepare(wire.TransferKey("t7"), list(range(7)), 100, layerwise=True)
    assert_nothing_held(s)


@pytest.mark.parametrize(
    "params, ids, on",
    [
        (PREFILL_PARAMS, range(6), True),  # 96 tokens of 100: prefilled in chunks
        (PREFILL_PARAMS, range(7), False),  # prepare_ahead off
        (None, range(7), True),  # no kv_transfer_params: no push
        (DECODE_PARAMS, range(7), True),  # a decode leg on a prefill engine: no push
    ],
)
def test_no_prepare_without_the_whole_prompt_or_a_push(params, ids, on):
    s = scheduler(prefill=True, prepare_ahead=on)
    s.update_state_after_alloc(request(params), blocks(*ids), 0)
    assert actions(s) == []


def test_a_prepare_that_fails_in_the_worker_fails_no_request():
    class Broken:
        def prepare(self, *args):
            raise RuntimeError("endpoint closed")

        def gauges(self):
            return {}

        def fallbacks(self):
            return {}

    worker = PushWorker(scheduler(prefill=True).config, None)
    worker.endpoint = Broken()
    worker.start([m.Prepare(wire.TransferKey("t7"), [1, 2], 20)])
    assert worker.results() == (set(), set(), set())
    stats = worker.take_stats()
    assert not stats.data["failures"], stats.data
    assert stats.data["fallbacks"] == {"ready_ahead:error": 1}  # counted, not silent


class Transfers:
    """An endpoint whose transfers end as the test says: a Future per request, resolved
    with an Outcome, or with an exception (an endpoint bug)."""

    def __init__(self, ends: dict[str, object]) -> None:
        self.ends = ends

    def _future(self, key):
        future: Future = Future()
        end = self.ends[key.transfer_id]
        if isinstance(end, Exception):
            future.set_exception(end)
        else:
            future.set_result(end)
        return future

    def expect(self, key, *args):
        return self._future(key)

    def push(self, key, *args):
        return self._future(key)

    def gauges(self):
        return {}

    def fallbacks(self):
        return {}


def expects(*rids: str, fault: str = "") -> list:
    prefill = PrefillAddress("127.0.0.1", 5600)
    return [m.Expect(r, wire.TransferKey(r), prefill, [1], 16, 0, fault) for r in rids]


def test_a_load_whose_result_cannot_be_read_fails_alone_and_every_other_is_reported():
    """The ids are collected before any result is read: one result that raises (here the
    first in the dict) neither hides the others nor leaves its own request waiting."""
    worker = PushWorker(scheduler().config, None)
    worker.endpoint = Transfers({"a": RuntimeError("endpoint bug"), "b": Outcome(True),
                                 "c": Outcome(False, "dead", cause="dead")})  # fmt: skip
    worker.start(expects("a", "b", "c"))
    assert worker.results() == (set(), {"a", "b", "c"}, {"a", "c"})
    assert worker.results() == (set(), set(), set())  # each reported once
    assert worker.take_stats().data["failures"] == {"other": 1, "dead": 1}


def test_a_push_whose_result_cannot_be_read_is_still_reported_sent():
    """vLLM frees prefill's blocks once the push is reported sent; the transfer is over."""
    worker = PushWorker(scheduler(prefill=True).config, None)
    worker.endpoint = Transfers({"a": RuntimeError("endpoint bug"), "b": Outcome(True)})
    worker.start([m.Push(r, wire.TransferKey(r), [1], 16) for r in ("a", "b")])
    assert worker.results() == ({"a", "b"}, set(), set())


@pytest.mark.parametrize("hook", ["start_load_kv", "get_finished"])
def test_injected_worker_faults_fail_the_load_alone(hook):
    """The faults tests/e2e/test_hook_faults.py injects into real engines' workers."""
    worker = PushWorker(scheduler(debug_faults=True).config, None)
    worker.endpoint = Transfers({"a": Outcome(True), "b": Outcome(True)})
    worker.start(expects("a", fault=hook) + expects("b"))
    assert worker.results() == (set(), {"a", "b"}, {"a"})


def test_the_scheduler_names_a_worker_fault_only_with_debug_faults():
    r = request(DECODE_PARAMS | {"kvpush_debug_fault": "get_finished"})
    for on, fault in ((False, ""), (True, "get_finished")):
        s = scheduler(debug_faults=on)
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, blocks(1, 2), 100)
        (expect,) = actions(s)
        assert expect.fault == fault
