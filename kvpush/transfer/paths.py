"""The paths a push can take on prefill, besides posting one WRITE when push() comes.

Each is a small collaborator of the prefill endpoint (writer.py), run on its loop thread,
acting on one transfer's record (`Transfer`) and the endpoint's agent, peers and matcher:

- `Plans`: the WRITE's copy plan, direct (one descriptor per contiguous run of both sides)
  or staged (gathered into a slot of prefill's staging area, one descriptor to decode's);
- `ReadyAhead`: the direct WRITE made ready from prepare()'s blocks before push() comes;
- `LayerByLayer`: the regions computed so far written while prefill computes the rest.

Every optimisation only ever saves time: where one fails, the push takes the plain path, and
the failure is counted (`kvpush:fallbacks{path,cause}`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpush.transfer import wire
from kvpush.transfer.layout import (
    CopyPlan,
    KVLayout,
    descs_per_run,
    padded_end,
    plan_copies,
    plan_regions,
)
from kvpush.transfer.matcher import Source, Write
from kvpush.transfer.staging import slot_layout, slot_size

if TYPE_CHECKING:
    from kvpush.transfer.writer import PrefillEndpoint

log = logging.getLogger(__name__)


@dataclass
class DecodePeer:
    agent_name: str
    layout: KVLayout
    engine_id: str
    rank: int


@dataclass
class InFlight:
    handle: Any
    started_s: float
    num_bytes: int
    num_descs: int
    slot: int | None = None  # staged: the staging slot it WRITEs from, freed when it ends


@dataclass
class Ahead:
    """A WRITE to one decode rank made ready before push() (see prepare()): its copy plan
    and its NIXL transfer, initialized and not posted."""

    reg: wire.RegisterMsg
    plan: Any
    handle: Any
    ready_s: float  # time.monotonic() when it was made ready


@dataclass
class Hint:
    """prepare()'s blocks for a key whose push() has not come, and the WRITEs made ready."""

    source: Source
    since_s: float
    ready: dict[str, Ahead] = field(default_factory=dict)  # by decode peer address


@dataclass
class Pieces:
    """A push to one decode rank written layer by layer: WRITEs (no notification) of the
    regions computed so far, posted while prefill computes the rest; the push then posts
    what is left, with the notification, once they have all completed."""

    reg: wire.RegisterMsg
    plan: CopyPlan  # the whole push's rows, as the push would post them
    regions: np.ndarray  # the region (index into the layout's regions) of each row
    sent: int = 0  # regions [0, sent) are posted
    flights: list[InFlight] = field(default_factory=list)
    final: Write | None = None  # the push's Write for this rank, held while pieces fly
    failure: wire.Failure | None = None  # a piece failed, or the key was aborted or cancelled
    settled: bool = False  # the matcher has had this rank's end (write_done)


@dataclass
class Layered:
    """A key whose push is written layer by layer (computed())."""

    source: Source  # prepare()'s blocks
    since_s: float
    done: set[int] = field(default_factory=set)  # regions computed
    peers: dict[str, Pieces] = field(default_factory=dict)  # by decode peer address
    first_s: float = 0.0  # time.monotonic() when its first piece was posted

    def in_flight(self) -> int:
        return sum(len(p.flights) for p in self.peers.values())


@dataclass
class Staged:
    """A WRITE gathered into a slot of prefill's staging area."""

    addr: int  # the slot
    size: int
    plan: Any  # the gather (layout.RegionPlan)
    end: int  # the token it stages up to (WrittenMsg.staged_end)


@dataclass
class Transfer:
    """Everything prefill holds for one key, from its first sign (prepare(), the scheduler's
    SOURCE, push() or computed()) to its end: `PrefillEndpoint._settle` is the one place
    that ends it and frees what is left."""

    key: wire.TransferKey
    future: Future | None = None  # push() (or SOURCE) came: resolved at the release
    released: bool = False
    unclaimed_s: float | None = None  # SOURCE started it then; push() has not come yet
    started_s: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)  # see Outcome.marks
    num_bytes: int = 0  # posted so far, every path
    num_descs: int = 0
    hint: Hint | None = None  # from prepare(), until the key ends
    layered: Layered | None = None  # from computed(), until its pieces are off the wire
    flights: dict[str, InFlight] = field(default_factory=dict)  # the push's WRITE, by peer

    @property
    def holding(self) -> bool:
        """push() (or SOURCE) came and the blocks are not released yet."""
        return self.future is not None and not self.released

    def mark(self, name: str, at_s: float | None = None, first: bool = True) -> None:
        """A timeline mark, while the source is held (none after its release)."""
        if self.holding and not (first and name in self.marks):
            self.marks[name] = time.monotonic() if at_s is None else at_s

    def count(self, num_bytes: int, num_descs: int) -> None:
        self.num_bytes += num_bytes
        self.num_descs += num_descs

    def idle(self) -> bool:
        """Nothing is held for it: the record can go."""
        return (
            not self.holding
            and self.unclaimed_s is None
            and self.hint is None
            and self.layered is None
            and not self.flights
        )


def record_gauges(records: Iterable[Transfer]) -> dict[str, int]:
    """Prefill's gauges that count what its transfers' records hold, in one pass (read after
    every turn of the endpoint's loop)."""
    in_flight = held = unclaimed = prepared = layered = layer_writes = 0
    for r in records:
        in_flight += len(r.flights)
        held += r.holding
        unclaimed += r.unclaimed_s is not None
        prepared += r.hint is not None
        if r.layered is not None:
            layered += 1
            layer_writes += r.layered.in_flight()
    return {
        "in_flight": in_flight,
        "held_sources": held,
        "unclaimed_sources": unclaimed,
        "prepared": prepared,
        "layered": layered,
        "layer_writes_in_flight": layer_writes,
    }


def _block_runs(block_ids: list[int], block_size: int, start: int, end: int) -> int:
    """Runs of consecutive block ids among the blocks covering tokens [start, end)."""
    ids = np.asarray(block_ids[start // block_size : -(-end // block_size)], dtype=np.int64)
    return 1 + int(np.count_nonzero(np.diff(ids) != 1)) if len(ids) else 0


class Plans:
    """Copy plans: direct, or gathered through a staging slot (staging.py)."""

    def __init__(self, ep: PrefillEndpoint) -> None:
        self.ep = ep

    def heads(self, reg: wire.RegisterMsg, source: Source) -> range:
        """The heads `reg` asks of this rank; raises when this rank cannot write them."""
        lay = self.ep.layout
        heads = range(*reg.heads)
        mine = range(lay.first_head, lay.first_head + lay.num_heads)
        if heads.start < mine.start or heads.stop > mine.stop:
            raise ValueError(f"registered heads {heads} are not held by this rank ({mine})")
        if reg.num_tokens > source.num_tokens:
            raise ValueError(
                f"decode expects {reg.num_tokens} tokens, prefill has {source.num_tokens}"
            )
        return heads

    def direct(
        self, reg: wire.RegisterMsg, source: Source, peer: DecodePeer, heads: range
    ) -> tuple[CopyPlan, np.ndarray, np.ndarray]:
        """The copy plan of a direct WRITE and its descriptors (prefill's, decode's)."""
        lay = self.ep.layout
        plan = plan_copies(
            lay,
            peer.layout,
            source.block_ids,
            reg.block_ids,
            reg.num_cached_tokens,
            reg.num_tokens,
            heads,
            pad_tail=True,
        )
        src, dst = plan.descs(lay.dev_id, peer.layout.dev_id)
        return plan, src, dst

    def wants_staging(
        self, reg: wire.RegisterMsg, source: Source, peer: DecodePeer, heads: range
    ) -> bool:
        """Whether a push goes through a staging slot when one is free: decode offered a
        slot, this rank has a staging area, and the direct plan would post at least
        staging_min_descs descriptors."""
        ep, lay = self.ep, self.ep.layout
        if not reg.staging_addr or ep.staging is None or ep.copier is None:
            return False
        start, end = reg.num_cached_tokens, padded_end(lay, peer.layout, reg.num_tokens)
        runs = max(
            _block_runs(source.block_ids, lay.block_size, start, end),
            _block_runs(reg.block_ids, peer.layout.block_size, start, end),
        )
        per_run = descs_per_run(lay, peer.layout, heads, start, end)
        return runs * per_run >= ep.config.staging_min_descs

    def stage(self, rec: Transfer, w: Write, peer: DecodePeer, heads: range) -> Staged | None:
        """Gather the push into a slot of this rank's staging area when it wants staging
        (above), and return it gathered. None: go direct (no staging here or there, few
        descriptors, no slot free, or the gather failed)."""
        ep, reg = self.ep, w.reg
        if not self.wants_staging(reg, w.source, peer, heads):
            return None
        assert ep.staging is not None and ep.copier is not None
        start, end = reg.num_cached_tokens, padded_end(ep.layout, peer.layout, reg.num_tokens)
        size = slot_size(peer.layout, heads, start, reg.num_tokens)
        if size > reg.staging_bytes:
            raise ValueError(f"decode's staging slot holds {reg.staging_bytes} B, need {size}")
        addr = ep.staging.reserve(size)
        if addr is None:
            ep.counters["staging_full"] += 1
            ep._fell_back("staged", "full")
            return None
        try:
            stage, ids = slot_layout(addr, peer.layout, heads, start, reg.num_tokens)
            gather = plan_regions(ep.layout, stage, w.source.block_ids, ids, start, end, heads)
            ep.copier.run(gather)
        except Exception as e:  # nothing reached decode yet: the direct path still can
            self.unstage(addr)
            ep.counters["staging_errors"] += 1
            ep._fell_back("staged", "error")
            log.warning("prefill: gather for %s failed, writing it direct: %s", w.key, e)
            return None
        ep.counters["staged"] += 1
        rec.mark("gathered")
        return Staged(addr, size, gather, end)

    def unstage(self, addr: int | None) -> None:
        if addr is not None and self.ep.staging is not None:
            self.ep.staging.release(addr)


class ReadyAhead:
    """The direct WRITE to each decode rank made ready from prepare()'s blocks (copy plan,
    NIXL transfer), so that push() only posts it."""

    def __init__(self, ep: PrefillEndpoint) -> None:
        self.ep = ep

    def make(self, rec: Transfer, address: str, reg: wire.RegisterMsg) -> None:
        """Make the direct WRITE of `rec` to `address` ready. A push that staging would
        gather is left to push(): the gather copies what prefill computed. Any error is left
        to push() too, which plans again and reports it."""
        ep, hint, peer = self.ep, rec.hint, self.ep.peers.get(address)
        if hint is None or peer is None or rec.holding:
            return
        self.forget(rec, address)
        try:
            heads = ep.plans.heads(reg, hint.source)
            if ep.plans.wants_staging(reg, hint.source, peer, heads):
                return
            plan, src, dst = ep.plans.direct(reg, hint.source, peer, heads)
            lay = ep.layout
            handle = ep.agent.initialize(
                "WRITE", peer.agent_name, src, dst, lay.mem_type, peer.layout.mem_type
            )
        except Exception as e:
            ep._fell_back("ready_ahead", "error")
            log.debug("prefill: no WRITE made ready ahead for %s: %s", rec.key, e)
            return
        hint.ready[address] = Ahead(reg, plan, handle, time.monotonic())

    def take(self, rec: Transfer, w: Write) -> Ahead | None:
        """The WRITE made ready for `w`, if it is for the same blocks and registration (else
        it is released, and `w` is planned afresh)."""
        hint = rec.hint
        ahead = hint.ready.pop(w.peer, None) if hint is not None else None
        if ahead is None:
            return None
        assert hint is not None
        if ahead.reg == w.reg and hint.source.block_ids == w.source.block_ids:
            return ahead
        self.ep.agent.release(ahead.handle)
        return None

    def forget(self, rec: Transfer, address: str) -> None:
        ahead = rec.hint.ready.pop(address, None) if rec.hint is not None else None
        if ahead is not None:
            self.ep.agent.release(ahead.handle)

    def drop(self, rec: Transfer) -> None:
        """The hint and every WRITE made ready from it."""
        hint, rec.hint = rec.hint, None
        for ahead in hint.ready.values() if hint is not None else ():
            self.ep.agent.release(ahead.handle)


class LayerByLayer:
    """Pushes written as the forward computes them: each key's regions computed so far go to
    every decode rank registered for it, without notification; push() then writes the rest
    with it (see PrefillEndpoint.computed)."""

    def __init__(self, ep: PrefillEndpoint) -> None:
        self.ep = ep
        self._computing: deque[tuple[list[wire.TransferKey], list[int], Any]] = deque()

    def computed(self, keys: list[wire.TransferKey], regions: list[int], ready: Any) -> None:
        self._computing.append((keys, regions, ready))
        self.take_computed()

    @property
    def waiting(self) -> bool:
        """Layers computed that are not yet ready to read (polled at the busy step)."""
        return bool(self._computing)

    def take_computed(self) -> None:
        """Act on the layers computed, in the order they came, each once it is ready; the
        layers of one key found ready together go out as one WRITE per decode rank (a loop
        thread behind a fast forward catches up, not one post per layer)."""
        taken: dict[wire.TransferKey, list[int]] = {}
        while self._computing:
            keys, regions, ready = self._computing[0]
            if ready is not None and not ready():
                break
            self._computing.popleft()
            for key in keys:
                taken.setdefault(key, []).extend(regions)
        for key, regions in taken.items():
            rec = self.ep.transfers.get(key)
            if rec is not None and self._layerable(rec):
                self._written_upto(rec, regions)

    def _layerable(self, rec: Transfer) -> bool:
        """prepare() came, push() has not, the key is alive, and its WRITEs are per region."""
        if rec.hint is None or rec.holding or self.ep.matcher.ended(rec.key):
            return False
        return not self.ep.layout.tiles_blocks

    def _written_upto(self, rec: Transfer, regions: list[int]) -> None:
        lay = rec.layered
        if lay is None:
            assert rec.hint is not None
            lay = rec.layered = Layered(rec.hint.source, time.monotonic())
            self.ep.counters["layered"] += 1
        lay.done.update(regions)
        for address in list(self.ep.matcher.registrations(rec.key)):
            self._begin(rec, lay, address)
        for address, pieces in lay.peers.items():
            self._post(rec, lay, address, pieces)

    def _begin(self, rec: Transfer, lay: Layered, address: str) -> None:
        """Write `address`'s registration layer by layer, where its push is a direct one."""
        ep = self.ep
        peer, reg = ep.peers.get(address), ep.matcher.registrations(rec.key).get(address)
        if peer is None or reg is None or peer.layout.tiles_blocks:
            return
        assert rec.hint is not None
        ahead = rec.hint.ready.get(address)
        try:
            if ahead is not None and ahead.reg == reg:  # prepare() planned it already
                plan = ahead.plan
            else:
                heads = ep.plans.heads(reg, lay.source)
                if ep.plans.wants_staging(reg, lay.source, peer, heads):
                    return
                plan, _, _ = ep.plans.direct(reg, lay.source, peer, heads)
        except Exception as e:  # push() plans it again and reports the error
            ep._fell_back("layerwise", "error")
            log.debug("prefill: %s not written layer by layer: %s", rec.key, e)
            return
        if ep.matcher.begin(rec.key, address) is None:
            return
        ep.ahead.forget(rec, address)  # the pieces replace the WRITE made ready
        lay.peers[address] = Pieces(reg, plan, self._region_of(plan.src_addrs))

    def _region_of(self, addrs: np.ndarray) -> np.ndarray:
        """The region each prefill address lies in (regions that do not overlap)."""
        bases = np.array([r.base_addr for r in self.ep.layout.regions], dtype=np.int64)
        order = np.argsort(bases)
        return order[np.searchsorted(bases[order], addrs, side="right") - 1]

    def _post(self, rec: Transfer, lay: Layered, address: str, pieces: Pieces) -> None:
        """Post the regions computed since the last piece, in order; the last region is
        always left to the push, whose WRITE carries the notification."""
        ep = self.ep
        if pieces.final is not None or pieces.failure is not None:
            return
        upto, last = pieces.sent, len(ep.layout.regions) - 1
        while upto < last and upto in lay.done:
            upto += 1
        if upto == pieces.sent:
            return
        rows = (pieces.regions >= pieces.sent) & (pieces.regions < upto)
        pieces.sent = upto
        if not rows.any():
            return
        part = pieces.plan.select(rows)
        peer = ep.peers[address]
        handle = None
        try:
            src, dst = part.descs(ep.layout.dev_id, peer.layout.dev_id)
            handle = ep.agent.initialize(
                "WRITE", peer.agent_name, src, dst, ep.layout.mem_type, peer.layout.mem_type
            )
            state = ep.agent.start(handle, b"")
        except Exception as e:
            if handle is not None:
                ep.agent.release(handle)
            ep._fell_back("layerwise", "error")
            pieces.failure = wire.Failure("write", f"WRITE of a layer not posted: {e}")
            self._settle(rec, address, pieces)
            return
        ep.counters["layer_writes"] += 1
        lay.first_s = lay.first_s or time.monotonic()
        rec.count(part.total_bytes, part.num_descs)
        pieces.flights.append(InFlight(handle, time.monotonic(), part.total_bytes, part.num_descs))
        ep._hurry()
        if state == "ERR":
            self.progress()

    def progress(self) -> None:
        for rec in [r for r in self.ep.transfers.values() if r.layered is not None]:
            assert rec.layered is not None
            for address, pieces in list(rec.layered.peers.items()):
                for flight in list(pieces.flights):
                    state = self.ep.agent.state(flight.handle)
                    if state == "PROC":
                        continue
                    pieces.flights.remove(flight)
                    self.ep.agent.release(flight.handle)
                    if state != "DONE" and pieces.failure is None:
                        why = f"NIXL WRITE of a layer ended {state}"
                        pieces.failure = wire.Failure("write", why)
                if not pieces.flights:
                    self._settle(rec, address, pieces)

    def _settle(self, rec: Transfer, address: str, pieces: Pieces) -> None:
        """No piece to `address` is on the wire: post the push's rest, or end this rank's
        write with the failure, or wait for the push."""
        if pieces.flights or pieces.settled:
            return
        if pieces.failure is not None:
            pieces.settled = True
            self.ep.apply(self.ep.matcher.write_done(rec.key, address, pieces.failure))
        elif pieces.final is not None:
            pieces.settled = True
            self.ep.post(pieces.final)

    def hold_final(self, rec: Transfer, w: Write) -> tuple[Pieces | None, bool]:
        """The push's Write `w` for a rank written layer by layer: its pieces (None when it
        is not), and whether the push must wait for them (posted once they are done)."""
        pieces = rec.layered.peers.get(w.peer) if rec.layered is not None else None
        if pieces is None or pieces.final is not None:
            return pieces, False
        pieces.final = w
        if pieces.flights or pieces.failure is not None:
            self._settle(rec, w.peer, pieces)  # or once they are done
            return pieces, True
        pieces.settled = True
        return pieces, False

    def rest(
        self, rec: Transfer, w: Write, pieces: Pieces, peer: DecodePeer
    ) -> tuple[CopyPlan, np.ndarray, np.ndarray] | None:
        """What the push still has to write to a rank written layer by layer: the regions
        not posted yet. None when the push's blocks or registration differ from the pieces'
        (it is then written whole, over what the pieces wrote)."""
        assert rec.layered is not None
        if w.reg != pieces.reg or w.source.block_ids != rec.layered.source.block_ids:
            return None
        rest = pieces.plan.select(pieces.regions >= pieces.sent)
        src, dst = rest.descs(self.ep.layout.dev_id, peer.layout.dev_id)
        return rest, src, dst

    def fail(self, rec: Transfer, failure: wire.Failure, peer: str = "") -> None:
        """No more pieces for `rec` (to `peer`, or to every rank not yet given its push):
        each rank's write ends with `failure` once its pieces on the wire are done."""
        lay = rec.layered
        for address, pieces in list(lay.peers.items()) if lay is not None else ():
            if (peer and address != peer) or pieces.final is not None:
                continue
            pieces.failure = pieces.failure or failure
            self._settle(rec, address, pieces)

    def expire(self, rec: Transfer) -> None:
        """Written in part, and its push() never came within the lease."""
        self.fail(rec, wire.Failure("lease", "lease expired: no push() came"))
        lay = rec.layered
        if lay is not None and all(p.settled and not p.flights for p in lay.peers.values()):
            rec.layered = None  # else once they are done

    def drop_peer(self, rec: Transfer, address: str) -> None:
        """`address` is dead: its pieces are released, not waited for."""
        pieces = rec.layered.peers.pop(address, None) if rec.layered is not None else None
        for flight in pieces.flights if pieces is not None else ():
            self.ep.agent.release(flight.handle)

    def close(self, rec: Transfer) -> None:
        for address in list(rec.layered.peers) if rec.layered is not None else ():
            self.drop_peer(rec, address)
        rec.layered = None
        self._computing.clear()
