"""Prefill side's pure state machine: registrations x finished sources, in either order.

It does no I/O: every event returns the actions for the writer to carry out. A transfer key
is paired with one source (the prefill blocks) and one registration per decode rank that
needs data from this prefill rank; the source is released once every one of them is written,
failed or cancelled.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.transfer.wire import CANCELLED, Failure, RegisterMsg, TransferKey


@dataclass(frozen=True)
class Source:
    block_ids: list[int]
    num_tokens: int
    first_token: int = -1  # the token prefill sampled, for decode to continue from; -1: none


@dataclass(frozen=True)
class Write:
    key: TransferKey
    peer: str
    reg: RegisterMsg
    source: Source


@dataclass(frozen=True)
class Reply:
    """Send a message to a decode peer: 'fail', 'ack' (cancel acknowledged) or 'done'."""

    peer: str
    kind: str
    key: TransferKey
    failure: Failure | None = None  # kind 'fail'


@dataclass(frozen=True)
class Release:
    """The source's blocks may be freed; a failure says why the push did not complete."""

    key: TransferKey
    failure: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


Action = Write | Reply | Release


@dataclass
class _Pending:
    created_s: float
    source: Source | None = None
    regs: dict[str, RegisterMsg] = field(default_factory=dict)  # peer -> not yet written
    writing: set[str] = field(default_factory=set)
    cancel_after_write: set[str] = field(default_factory=set)
    num_done: int = 0
    num_expected: int | None = None  # decode ranks that will register
    failure: Failure | None = None  # set when the transfer failed while writes were on the wire
    early: dict[str, RegisterMsg] = field(default_factory=dict)  # peer -> written layer by
    # layer before the source came (begin()); also in `writing`


class Matcher:
    def __init__(
        self, lease_s: float, max_records: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self.max_records = max_records
        self._pending: dict[TransferKey, _Pending] = {}
        # Keys that ended (finished, failed, cancelled), kept for one lease so that a late
        # message gets an answer at once: key -> (failure or None, monotonic time it ended).
        self._records: OrderedDict[TransferKey, tuple[Failure | None, float]] = OrderedDict()

    # -- gauges -------------------------------------------------------------------------
    @property
    def num_pending_match(self) -> int:
        return sum(1 for p in self._pending.values() if not p.writing)

    @property
    def num_registrations(self) -> int:
        """Decode ranks registered and not yet being written."""
        return sum(len(p.regs) for p in self._pending.values())

    @property
    def num_in_flight(self) -> int:
        return sum(len(p.writing) for p in self._pending.values())

    @property
    def num_records(self) -> int:
        return len(self._records)

    def ended(self, key: TransferKey) -> bool:
        """Whether `key` ended (written, failed, cancelled) within the last lease."""
        return key in self._records

    def has_pending(self) -> bool:
        return bool(self._pending)

    def registrations(self, key: TransferKey) -> dict[str, RegisterMsg]:
        """The registrations of `key` not written yet, by decode peer."""
        p = self._pending.get(key)
        return dict(p.regs) if p is not None else {}

    def peers_with_pending(self) -> set[str]:
        return {peer for p in self._pending.values() for peer in (*p.regs, *p.writing)}

    # -- events -------------------------------------------------------------------------
    def source_ready(self, key: TransferKey, source: Source) -> list[Action]:
        now_s = self._clock()
        if key in self._records:
            return [Release(key, self._late(key, "already ended"))]
        p = self._pending.setdefault(key, _Pending(created_s=now_s))
        if p.source is not None:
            return [Release(key, Failure("other", f"transfer {key} already has a source"))]
        p.source, p.created_s = source, now_s
        actions: list[Action] = [Write(key, peer, reg, source) for peer, reg in p.early.items()]
        p.early.clear()
        actions += [self._write(key, p, peer) for peer in list(p.regs)]
        return actions + self._maybe_finish(key, p)

    def begin(self, key: TransferKey, peer: str) -> RegisterMsg | None:
        """The writer starts writing `peer`'s registration before the source, layer by layer
        (PrefillEndpoint.computed): from now on it is being written (a cancel is answered
        once the writing ends, a registration sent again is refused), and the source's
        Write for it follows. Its end comes through write_done, as any WRITE's. None:
        `peer` has no registration of `key` to write, or the source is in."""
        p = self._pending.get(key)
        if p is None or p.source is not None or peer not in p.regs:
            return None
        p.writing.add(peer)
        p.early[peer] = p.regs.pop(peer)
        return p.early[peer]

    def register(self, peer: str, reg: RegisterMsg) -> list[Action]:
        now_s = self._clock()
        key = reg.key
        if key in self._records:
            return [Reply(peer, "fail", key, self._late(key, "already ended on prefill"))]
        p = self._pending.setdefault(key, _Pending(created_s=now_s))
        if peer in p.writing:
            failure = Failure("refused", f"transfer {key} re-registered while writing")
            return [Reply(peer, "fail", key, failure)]
        p.regs[peer] = reg  # a re-sent registration replaces the unwritten one
        p.num_expected = reg.num_registrations
        if reg.num_cached_tokens >= reg.num_tokens:
            del p.regs[peer]
            p.num_done += 1
            return [Reply(peer, "done", key)] + self._maybe_finish(key, p)
        if p.source is None:
            return []
        return [self._write(key, p, peer)]

    def cancel(self, peer: str, key: TransferKey) -> list[Action]:
        p = self._pending.get(key)
        if p is None:  # cancelled before it registered: a later source is freed at once
            if key not in self._records:
                self._record(key, CANCELLED)
            return [Reply(peer, "ack", key)]
        if peer in p.writing:
            p.cancel_after_write.add(peer)
            return []
        p.regs.pop(peer, None)
        return [Reply(peer, "ack", key)] + self._end(key, p, CANCELLED)

    def write_done(self, key: TransferKey, peer: str, failure: Failure | None) -> list[Action]:
        """A WRITE to `peer` completed (failure None) or failed."""
        p = self._pending.get(key)
        if p is None or peer not in p.writing:
            return []
        p.writing.discard(peer)
        p.early.pop(peer, None)
        actions: list[Action] = []
        if peer in p.cancel_after_write:
            p.cancel_after_write.discard(peer)
            actions.append(Reply(peer, "ack", key))
        if failure is not None:
            actions.append(Reply(peer, "fail", key, failure))
            return actions + self._end(key, p, failure)
        p.num_done += 1
        if p.failure is not None:
            return actions + self._end(key, p, p.failure)
        return actions + self._maybe_finish(key, p)

    def abort(self, key: TransferKey, failure: Failure) -> list[Action]:
        """Prefill gave up on the request (aborted or failed), or the router did, before
        writing."""
        p = self._pending.get(key)
        if p is None:
            self._record(key, failure)
            return []
        if p.writing:  # data is on the wire; its completion decides
            return []
        return self._end(key, p, failure)

    def peer_dead(self, peer: str, failure: Failure) -> list[Action]:
        actions: list[Action] = []
        for key, p in list(self._pending.items()):
            if peer in p.regs or peer in p.writing:
                p.regs.pop(peer, None)
                p.early.pop(peer, None)
                p.writing.discard(peer)
                p.cancel_after_write.discard(peer)
                actions += self._end(key, p, failure)
        return actions

    def expire(self) -> list[Action]:
        now_s = self._clock()
        while self._records and now_s - next(iter(self._records.values()))[1] > self.lease_s:
            self._records.popitem(last=False)
        actions: list[Action] = []
        for key, p in list(self._pending.items()):
            if not p.writing and now_s - p.created_s > self.lease_s:
                who = "decode never registered" if p.source else "prefill never finished"
                actions += self._end(key, p, Failure("lease", f"lease expired: {who}"))
        return actions

    def next_record_expiry_s(self) -> float | None:
        if not self._records:
            return None
        return next(iter(self._records.values()))[1] + self.lease_s

    # -- internals ----------------------------------------------------------------------
    def _write(self, key: TransferKey, p: _Pending, peer: str) -> Write:
        assert p.source is not None
        p.writing.add(peer)
        return Write(key, peer, p.regs.pop(peer), p.source)

    def _maybe_finish(self, key: TransferKey, p: _Pending) -> list[Action]:
        if p.source is None or p.writing or p.regs:
            return []
        if p.num_expected is not None and p.num_done >= p.num_expected:
            return self._end(key, p, None)
        return []

    def _end(self, key: TransferKey, p: _Pending, failure: Failure | None) -> list[Action]:
        """The transfer is written (failure None) or failed."""
        actions: list[Action] = [Reply(peer, "fail", key, failure) for peer in p.regs]
        p.regs.clear()
        if p.writing:  # free only once the writes on the wire have completed
            p.failure = p.failure or failure
            return actions
        del self._pending[key]
        self._record(key, failure)
        if p.source is not None:
            actions.append(Release(key, failure))
        return actions

    def _late(self, key: TransferKey, what: str) -> Failure:
        """For a message about a key that has ended: its own failure's cause, or 'refused'."""
        failure = self._records[key][0]
        reason = failure.reason if failure else "written"
        return Failure(failure.cause if failure else "refused", f"transfer {key} {what}: {reason}")

    def _record(self, key: TransferKey, failure: Failure | None) -> None:
        self._records[key] = (failure, self._clock())
        self._records.move_to_end(key)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)
