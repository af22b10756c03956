"""The prefill side's pairing state machine, event by event (no I/O)."""

from __future__ import annotations

import pytest

from kvpush.transfer.matcher import Matcher, Release, Reply, Source, Write
from kvpush.transfer.wire import Failure, RegisterMsg, TransferKey

KEY = TransferKey("t", 0)
SRC = Source([1, 2], 32)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def reg(key=KEY, cached=0, ranks=1, blocks=(5, 6)):
    return RegisterMsg(key, list(blocks), 32, cached, (0, 2), ranks)


def kinds(actions):
    return [type(a).__name__ + (f":{a.kind}" if isinstance(a, Reply) else "") for a in actions]


def test_registration_first_then_source_writes_then_releases():
    m = Matcher(lease_s=30)
    assert m.register("d", reg()) == []
    (write,) = m.source_ready(KEY, SRC)
    assert isinstance(write, Write) and write.peer == "d"
    assert m.num_in_flight == 1
    (release,) = m.write_done(KEY, "d", None)
    assert release == Release(KEY) and release.ok
    assert not m.has_pending()


def test_source_first_then_registration():
    m = Matcher(lease_s=30)
    assert m.source_ready(KEY, SRC) == []
    assert kinds(m.register("d", reg())) == ["Write"]


def test_source_waits_for_every_decode_rank():
    m = Matcher(lease_s=30)
    m.source_ready(KEY, SRC)
    m.register("d0", reg(ranks=2))
    assert m.write_done(KEY, "d0", None) == []  # d1 still owed
    m.register("d1", reg(ranks=2))
    assert kinds(m.write_done(KEY, "d1", None)) == ["Release"]


def test_resent_registration_replaces_the_unwritten_one():
    m = Matcher(lease_s=30)
    m.register("d", reg(blocks=(1, 2)))
    m.register("d", reg(blocks=(7, 8)))
    (write,) = m.source_ready(KEY, SRC)
    assert write.reg.block_ids == [7, 8]


def test_late_registration_and_cancel_for_an_ended_key_are_answered_at_once():
    m = Matcher(lease_s=30)
    m.source_ready(KEY, SRC)
    m.register("d", reg())
    m.write_done(KEY, "d", None)
    (fail,) = m.register("d", reg())
    # a registration for a key already written is one prefill cannot serve
    assert fail.kind == "fail" and fail.failure.cause == "refused"
    assert "already ended on prefill: written" in fail.failure.reason
    assert kinds(m.cancel("d", KEY)) == ["Reply:ack"]
    assert not m.has_pending()


def test_cancel_before_write_acks_and_a_later_source_is_freed_at_once():
    m = Matcher(lease_s=30)
    m.register("d", reg())
    assert kinds(m.cancel("d", KEY)) == ["Reply:ack"]
    (release,) = m.source_ready(KEY, SRC)  # recorded as cancelled
    assert not release.ok and release.failure.cause == "cancelled"


def test_cancel_during_write_is_acked_after_the_write():
    m = Matcher(lease_s=30)
    m.register("d", reg())
    m.source_ready(KEY, SRC)
    assert m.cancel("d", KEY) == []
    assert kinds(m.write_done(KEY, "d", None)) == ["Reply:ack", "Release"]


def test_full_prefix_hit_answers_done_and_frees_with_the_source():
    m = Matcher(lease_s=30)
    assert kinds(m.register("d", reg(cached=32))) == ["Reply:done"]
    assert m.source_ready(KEY, SRC) == [Release(KEY)]


def test_lease_expires_either_side_and_records_expire_after_a_lease():
    clock = Clock()
    m = Matcher(lease_s=10, clock=clock)
    m.source_ready(TransferKey("a"), SRC)
    m.register("d", reg(key=TransferKey("b")))
    clock.now_s = 5.0
    assert m.expire() == []
    clock.now_s = 10.5
    actions = m.expire()
    assert kinds(actions) == ["Release", "Reply:fail"]
    assert actions[0].failure == Failure("lease", "lease expired: decode never registered")
    assert actions[1].failure == Failure("lease", "lease expired: prefill never finished")
    assert m.num_records == 2 and not m.has_pending()
    clock.now_s = 21.0
    m.expire()
    assert m.num_records == 0


def test_failed_write_fails_decode_and_releases():
    m = Matcher(lease_s=30)
    m.register("d", reg())
    m.source_ready(KEY, SRC)
    boom = Failure("write", "boom")
    fail, release = m.write_done(KEY, "d", boom)
    assert (fail.kind, fail.failure, release.failure) == ("fail", boom, boom)


def test_dead_peer_releases_its_sources_but_not_others():
    m = Matcher(lease_s=30)
    other = TransferKey("other")
    m.register("d", reg())
    m.register("e", reg(key=other))
    m.source_ready(KEY, SRC)
    m.source_ready(other, SRC)
    actions = m.peer_dead("d", Failure("dead", "d is dead"))
    assert [a.key for a in actions if isinstance(a, Release)] == [KEY]
    assert {a.failure.cause for a in actions} == {"dead"}
    assert m.has_pending()


def test_abort_fails_the_registered_decode_and_records_the_key():
    m = Matcher(lease_s=30)
    m.register("d", reg())
    assert kinds(m.abort(KEY, Failure("aborted", "prefill aborted"))) == ["Reply:fail"]
    (fail,) = m.register("d", reg())  # a late one gets the recorded cause
    assert fail.failure == Failure(
        "aborted", f"transfer {KEY} already ended on prefill: prefill aborted"
    )


def test_a_failure_names_a_known_cause():
    with pytest.raises(ValueError, match="unknown failure cause 'lost'"):
        Failure("lost", "?")


def test_a_registration_begun_before_the_source_is_written_when_the_source_comes():
    """Layer by layer (PrefillEndpoint.computed): begin() takes the registration early."""
    m = Matcher(lease_s=30)
    m.register("d", reg())
    assert m.begin(KEY, "d") == reg()
    assert m.begin(KEY, "d") is None  # once
    assert m.registrations(KEY) == {} and m.num_in_flight == 1
    (fail,) = m.register("d", reg(blocks=(7, 8)))  # its blocks are being written
    assert fail.kind == "fail" and fail.failure.cause == "refused"
    (write,) = m.source_ready(KEY, SRC)
    assert (write.peer, write.reg, write.source) == ("d", reg(), SRC)
    assert kinds(m.write_done(KEY, "d", None)) == ["Release"]
    assert not m.has_pending()


def test_a_begun_registration_is_cancelled_or_aborted_only_once_its_writing_ends():
    m = Matcher(lease_s=30)
    m.register("d", reg())
    m.begin(KEY, "d")
    assert m.cancel("d", KEY) == []  # answered when the writer says the writing ended
    cancelled = Failure("cancelled", "cancelled by decode")
    assert kinds(m.write_done(KEY, "d", cancelled)) == ["Reply:ack", "Reply:fail"]
    assert m.ended(KEY)
    (release,) = m.source_ready(KEY, SRC)
    assert release.failure.cause == "cancelled"

    other = TransferKey("u", 0)
    m.register("d", reg(key=other))
    m.begin(other, "d")
    aborted = Failure("aborted", "client left")
    assert m.abort(other, aborted) == []  # pieces may be on the wire
    assert kinds(m.write_done(other, "d", aborted)) == ["Reply:fail"]
    assert m.ended(other) and not m.has_pending()


def test_nothing_is_begun_without_a_registration_or_after_the_source():
    m = Matcher(lease_s=30)
    assert m.begin(KEY, "d") is None
    m.source_ready(KEY, SRC)
    m.register("d2", reg(ranks=2))  # written at once: the source is in
    assert m.begin(KEY, "d2") is None
