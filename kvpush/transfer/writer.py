"""Prefill endpoint: the background writer that pushes finished prefills into decode blocks.

The caller (vLLM's worker, or a test) calls `push()` when a request's prefill is done and
gets a future that resolves when its blocks may be freed. Everything else happens on the
loop thread: handshakes, matching (matcher.py), descriptor builds, WRITE posts, completion.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.transfer import wire
from kvpush.transfer.endpoint import BUSY_POLL_MS, LEASE_POLL_MS, Endpoint, Outcome, resolved
from kvpush.transfer.layout import (
    CopyPlan,
    KVLayout,
    descs_per_run,
    digest,
    padded_end,
    plan_copies,
    plan_regions,
)
from kvpush.transfer.matcher import Action, Matcher, Release, Reply, Source, Write
from kvpush.transfer.staging import slot_layout, slot_size

log = logging.getLogger(__name__)


@dataclass
class _DecodePeer:
    agent_name: str
    layout: KVLayout
    engine_id: str
    rank: int


@dataclass
class _InFlight:
    handle: Any
    started_s: float
    num_bytes: int
    num_descs: int
    slot: int | None = None  # staged: the staging slot it WRITEs from, freed when it ends


@dataclass(frozen=True)
class _Staged:
    """A WRITE gathered into a slot of prefill's staging area."""

    addr: int  # the slot
    size: int
    plan: Any  # the gather (layout.RegionPlan)
    end: int  # the token it stages up to (WrittenMsg.staged_end)


@dataclass
class _Ahead:
    """A WRITE to one decode rank made ready before push() (see prepare()): its copy plan
    and its NIXL transfer, initialized and not posted."""

    reg: wire.RegisterMsg
    plan: Any
    handle: Any
    ready_s: float  # time.monotonic() when it was made ready


@dataclass
class _Hint:
    """prepare()'s blocks for a key whose push() has not come, and the WRITEs made ready."""

    source: Source
    since_s: float
    ready: dict[str, _Ahead] = field(default_factory=dict)  # by decode peer address


@dataclass
class _Pieces:
    """A push to one decode rank written layer by layer: WRITEs (no notification) of the
    regions computed so far, posted while prefill computes the rest; the push then posts
    what is left, with the notification, once they have all completed."""

    reg: wire.RegisterMsg
    plan: CopyPlan  # the whole push's rows, as the push would post them
    regions: np.ndarray  # the region (index into the layout's regions) of each row
    sent: int = 0  # regions [0, sent) are posted
    flights: list[_InFlight] = field(default_factory=list)
    final: Write | None = None  # the push's Write for this rank, held while pieces fly
    failure: wire.Failure | None = None  # a piece failed, or the key was aborted or cancelled
    settled: bool = False  # the matcher has had this rank's end (write_done)


@dataclass
class _Layered:
    """A key whose push is written layer by layer (computed())."""

    source: Source  # prepare()'s blocks
    since_s: float
    done: set[int] = field(default_factory=set)  # regions computed
    peers: dict[str, _Pieces] = field(default_factory=dict)  # by decode peer address
    first_s: float = 0.0  # time.monotonic() when its first piece was posted


def _block_runs(block_ids: list[int], block_size: int, start: int, end: int) -> int:
    """Runs of consecutive block ids among the blocks covering tokens [start, end)."""
    ids = np.asarray(block_ids[start // block_size : -(-end // block_size)], dtype=np.int64)
    return 1 + int(np.count_nonzero(np.diff(ids) != 1)) if len(ids) else 0


class PrefillEndpoint(Endpoint):
    role = "prefill"

    def __init__(self, config: Any, layout: KVLayout) -> None:
        self._matcher = Matcher(config.lease_s)
        self._peers: dict[str, _DecodePeer] = {}  # by decode side-channel address
        self._in_flight: dict[tuple[wire.TransferKey, str], _InFlight] = {}
        self._futures: dict[wire.TransferKey, Future] = {}
        self._stats: dict[wire.TransferKey, list[int]] = {}  # bytes, descriptors so far
        self._started: dict[wire.TransferKey, float] = {}
        self._marks: dict[wire.TransferKey, dict[str, float]] = {}  # see Outcome.marks
        # Sources started from the scheduler's SOURCE whose push() has not come yet: the
        # future it will get, and when the source came (dropped after one lease).
        self._unclaimed: dict[wire.TransferKey, tuple[Future, float]] = {}
        self._hints: dict[wire.TransferKey, _Hint] = {}  # from prepare(), until the release
        self._layered: dict[wire.TransferKey, _Layered] = {}  # from computed()
        self._computing: deque[tuple[list[wire.TransferKey], list[int], Any]] = deque()
        # WRITEs gathered through a staging slot, and WRITEs sent direct because this rank's
        # staging area had no slot free or the gather failed; WRITEs posted as prepare()
        # made them ready
        # and pushes written layer by layer, and their WRITEs posted before the push
        self.counters = {
            "staged": 0,
            "staging_full": 0,
            "staging_errors": 0,
            "ready_ahead": 0,
            "layered": 0,
            "layer_writes": 0,
        }
        super().__init__(config, layout)

    # -- API, any thread ----------------------------------------------------------------
    def push(
        self, key: wire.TransferKey, block_ids: list[int], num_tokens: int, first_token: int = -1
    ) -> Future:
        """Prefill of `key` is done: write it to decode (with the first token prefill sampled,
        in each WRITE's notification). Resolves when the blocks may be freed."""
        source = Source(list(block_ids), num_tokens, first_token)
        return self._call(self._on_source, key, source)

    def prepare(self, key: wire.TransferKey, block_ids: list[int], num_tokens: int) -> Future:
        """A head start: `key`'s blocks are final (vLLM is computing its last prompt tokens).
        The WRITE to each decode rank registered for it is made ready now (copy plan, NIXL
        transfer), and to each that registers later, so that push() only posts it. Only ever
        saves time: push() uses it only for the same blocks and the same registration.
        Resolves once the loop thread has acted on it."""
        return self._call(self._on_prepare, key, Source(list(block_ids), num_tokens))

    def computed(
        self, keys: list[wire.TransferKey], regions: list[int], ready: Any = None
    ) -> Future:
        """Layer by layer: the forward has computed `regions` (indices into the layout's
        regions) of every key in `keys`, each prepare()d. The loop thread writes each key's
        regions computed so far, in order, to every decode rank registered for it, without
        notification; push() then writes the rest, with it. `ready`, where given, is polled
        on the loop thread (it must not block) until it returns True before the regions are
        read: on a GPU, whether the layer's kernels have run. Not for a push that staging
        would gather, nor across a block-outer layout (one descriptor spans every region
        there): those are written whole by push()."""
        return self._call(self._on_computed, keys, regions, ready)

    def abort(self, key: wire.TransferKey, failure: wire.Failure) -> Future:
        """The prefill request failed or was aborted: tell decode, hold nothing. Resolves
        once the loop thread has acted on it (and refreshed the gauges)."""
        return self._call(self._on_abort, key, failure)

    # -- loop thread --------------------------------------------------------------------
    def _on_source(self, key: wire.TransferKey, source: Source, sourced: bool = False) -> Future:
        early = self._unclaimed.pop(key, None)
        if early is not None:  # started from SOURCE already: this is the same push
            return early[0]
        if key in self._futures:
            failure = wire.Failure("other", f"transfer {key} is already being pushed")
            return resolved(Outcome.failed(failure))
        future: Future = Future()
        self._futures[key] = future
        self._started[key] = time.monotonic()
        self._marks[key] = {"handed": self._started[key]}
        if sourced:  # from the scheduler's SOURCE, ahead of push()
            self._marks[key]["sourced"] = self._started[key]
        lay = self._layered.get(key)
        if lay is not None and lay.first_s:  # layers written before it
            self._marks[key]["layered"] = lay.first_s
        self._apply(self._matcher.source_ready(key, source))
        return future

    def _on_prepare(self, key: wire.TransferKey, source: Source) -> None:
        if key in self._futures or self._matcher.ended(key) or key in self._layered:
            return  # push() came first, the transfer has ended, or it is being written
        self._drop_hint(key)  # the request was scheduled again (preempted): the new blocks
        self._hints[key] = _Hint(source, time.monotonic())
        for peer, reg in self._matcher.registrations(key).items():
            self._ready_ahead(key, peer, reg)

    def _ready_ahead(self, key: wire.TransferKey, address: str, reg: wire.RegisterMsg) -> None:
        """Make the direct WRITE of `key` to `address` ready from prepare()'s blocks. A push
        that staging would gather is left to push(): the gather copies what prefill
        computed. Any error is left to push() too, which plans again and reports it."""
        hint, peer = self._hints.get(key), self._peers.get(address)
        if hint is None or peer is None or key in self._futures:
            return
        self._forget_ready(key, address)
        try:
            heads = self._heads(reg, hint.source)
            if self._wants_staging(reg, hint.source, peer, heads):
                return
            plan, src, dst = self._direct(reg, hint.source, peer, heads)
            lay = self.layout
            handle = self.agent.initialize(
                "WRITE", peer.agent_name, src, dst, lay.mem_type, peer.layout.mem_type
            )
        except Exception as e:
            self._fell_back("ready_ahead", "error")
            log.debug("prefill: no WRITE made ready ahead for %s: %s", key, e)
            return
        hint.ready[address] = _Ahead(reg, plan, handle, time.monotonic())

    def _take_ahead(self, w: Write) -> _Ahead | None:
        """The WRITE prepare() made ready for `w`, if it is for the same blocks and
        registration (else it is released, and `w` is planned afresh)."""
        hint = self._hints.get(w.key)
        ahead = hint.ready.pop(w.peer, None) if hint is not None else None
        if ahead is None:
            return None
        assert hint is not None
        if ahead.reg == w.reg and hint.source.block_ids == w.source.block_ids:
            return ahead
        self.agent.release(ahead.handle)
        return None

    def _forget_ready(self, key: wire.TransferKey, address: str) -> None:
        hint = self._hints.get(key)
        ahead = hint.ready.pop(address, None) if hint is not None else None
        if ahead is not None:
            self.agent.release(ahead.handle)

    def _drop_hint(self, key: wire.TransferKey) -> None:
        hint = self._hints.pop(key, None)
        for ahead in hint.ready.values() if hint is not None else ():
            self.agent.release(ahead.handle)

    # -- layer by layer -----------------------------------------------------------------
    def _on_computed(self, keys: list[wire.TransferKey], regions: list[int], ready: Any) -> None:
        self._computing.append((keys, regions, ready))
        self._take_computed()

    def _take_computed(self) -> None:
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
            if self._layerable(key):
                self._written_upto(key, regions)

    def _written_upto(self, key: wire.TransferKey, regions: list[int]) -> None:
        lay = self._layered.get(key)
        if lay is None:
            lay = self._layered[key] = _Layered(self._hints[key].source, time.monotonic())
            self.counters["layered"] += 1
        lay.done.update(regions)
        for address in list(self._matcher.registrations(key)):
            self._begin_pieces(key, lay, address)
        for address, pieces in lay.peers.items():
            self._post_pieces(key, lay, address, pieces)

    def _layerable(self, key: wire.TransferKey) -> bool:
        """prepare() came, push() has not, the key is alive, and its WRITEs are per region."""
        if key not in self._hints or key in self._futures or self._matcher.ended(key):
            return False
        return not self.layout.tiles_blocks

    def _begin_pieces(self, key: wire.TransferKey, lay: _Layered, address: str) -> None:
        """Write `address`'s registration layer by layer, where its push is a direct one."""
        peer, reg = self._peers.get(address), self._matcher.registrations(key).get(address)
        if peer is None or reg is None or peer.layout.tiles_blocks:
            return
        hint = self._hints[key]
        ahead = hint.ready.get(address)
        try:
            if ahead is not None and ahead.reg == reg:  # prepare() planned it already
                plan = ahead.plan
            else:
                heads = self._heads(reg, lay.source)
                if self._wants_staging(reg, lay.source, peer, heads):
                    return
                plan, _, _ = self._direct(reg, lay.source, peer, heads)
        except Exception as e:  # push() plans it again and reports the error
            self._fell_back("layerwise", "error")
            log.debug("prefill: %s not written layer by layer: %s", key, e)
            return
        if self._matcher.begin(key, address) is None:
            return
        self._forget_ready(key, address)  # the pieces replace the WRITE made ready
        lay.peers[address] = _Pieces(reg, plan, self._region_of(plan.src_addrs))

    def _region_of(self, addrs: np.ndarray) -> np.ndarray:
        """The region each prefill address lies in (regions that do not overlap)."""
        bases = np.array([r.base_addr for r in self.layout.regions], dtype=np.int64)
        order = np.argsort(bases)
        return order[np.searchsorted(bases[order], addrs, side="right") - 1]

    def _post_pieces(
        self, key: wire.TransferKey, lay: _Layered, address: str, pieces: _Pieces
    ) -> None:
        """Post the regions computed since the last piece, in order; the last region is
        always left to the push, whose WRITE carries the notification."""
        if pieces.final is not None or pieces.failure is not None:
            return
        upto, last = pieces.sent, len(self.layout.regions) - 1
        while upto < last and upto in lay.done:
            upto += 1
        if upto == pieces.sent:
            return
        rows = (pieces.regions >= pieces.sent) & (pieces.regions < upto)
        pieces.sent = upto
        if not rows.any():
            return
        part = pieces.plan.select(rows)
        peer = self._peers[address]
        handle = None
        try:
            src, dst = part.descs(self.layout.dev_id, peer.layout.dev_id)
            handle = self.agent.initialize(
                "WRITE", peer.agent_name, src, dst, self.layout.mem_type, peer.layout.mem_type
            )
            state = self.agent.start(handle, b"")
        except Exception as e:
            if handle is not None:
                self.agent.release(handle)
            self._fell_back("layerwise", "error")
            pieces.failure = wire.Failure("write", f"WRITE of a layer not posted: {e}")
            self._settle_pieces(key, address, pieces)
            return
        self.counters["layer_writes"] += 1
        lay.first_s = lay.first_s or time.monotonic()
        stats = self._stats.setdefault(key, [0, 0])
        stats[0] += part.total_bytes
        stats[1] += part.num_descs
        pieces.flights.append(_InFlight(handle, time.monotonic(), part.total_bytes, part.num_descs))
        self._hurry()
        if state == "ERR":
            self._progress_pieces()

    def _progress_pieces(self) -> None:
        for key, lay in list(self._layered.items()):
            for address, pieces in list(lay.peers.items()):
                for flight in list(pieces.flights):
                    state = self.agent.state(flight.handle)
                    if state == "PROC":
                        continue
                    pieces.flights.remove(flight)
                    self.agent.release(flight.handle)
                    if state != "DONE" and pieces.failure is None:
                        why = f"NIXL WRITE of a layer ended {state}"
                        pieces.failure = wire.Failure("write", why)
                if not pieces.flights:
                    self._settle_pieces(key, address, pieces)

    def _settle_pieces(self, key: wire.TransferKey, address: str, pieces: _Pieces) -> None:
        """No piece to `address` is on the wire: post the push's rest, or end this rank's
        write with the failure, or wait for the push."""
        if pieces.flights or pieces.settled:
            return
        if pieces.failure is not None:
            pieces.settled = True
            self._apply(self._matcher.write_done(key, address, pieces.failure))
        elif pieces.final is not None:
            pieces.settled = True
            self._post(pieces.final)

    def _pieces_for(self, w: Write) -> _Pieces | None:
        lay = self._layered.get(w.key)
        return lay.peers.get(w.peer) if lay is not None else None

    def _rest(self, w: Write, pieces: _Pieces) -> tuple[CopyPlan, np.ndarray, np.ndarray] | None:
        """What the push still has to write to a rank written layer by layer: the regions
        not posted yet. None when the push's blocks or registration differ from the pieces'
        (it is then written whole, over what the pieces wrote)."""
        lay = self._layered[w.key]
        if w.reg != pieces.reg or w.source.block_ids != lay.source.block_ids:
            return None
        rest = pieces.plan.select(pieces.regions >= pieces.sent)
        src, dst = rest.descs(self.layout.dev_id, self._peers[w.peer].layout.dev_id)
        return rest, src, dst

    def _on_abort(self, key: wire.TransferKey, failure: wire.Failure) -> None:
        self._apply(self._matcher.abort(key, failure))
        self._fail_pieces(key, failure)

    def _fail_pieces(self, key: wire.TransferKey, failure: wire.Failure, peer: str = "") -> None:
        """No more pieces for `key` (to `peer`, or to every rank not yet given its push):
        each rank's write ends with `failure` once its pieces on the wire are done."""
        lay = self._layered.get(key)
        for address, pieces in list(lay.peers.items()) if lay is not None else ():
            if (peer and address != peer) or pieces.final is not None:
                continue
            pieces.failure = pieces.failure or failure
            self._settle_pieces(key, address, pieces)

    def _drop_layered(self) -> None:
        """Forget keys that ended with nothing of theirs on the wire."""
        for key, lay in list(self._layered.items()):
            if self._matcher.ended(key) and not any(p.flights for p in lay.peers.values()):
                self._forget_layered(key)

    def _forget_layered(self, key: wire.TransferKey) -> None:
        self._layered.pop(key, None)
        if key not in self._futures:  # no push() to report the pieces' figures
            self._stats.pop(key, None)

    def _apply_all(self, fn: Any, *args: Any) -> None:
        self._apply(fn(*args))

    def _receive(self, env: wire.Envelope) -> None:
        link = self._link_for(env)
        msg, peer = env.msg, env.reply_to
        if isinstance(msg, wire.HelloMsg):
            self._on_hello(link, msg)
        elif isinstance(msg, wire.HeartbeatMsg):
            pass
        elif isinstance(msg, wire.CancelMsg):  # needs no handshake: it only frees
            self._forget_ready(msg.key, peer)
            self._apply(self._matcher.cancel(peer, msg.key))
            self._fail_pieces(msg.key, wire.CANCELLED, peer)  # answered once they are done
        elif peer not in self._peers or link.peer is None:
            key = getattr(msg, "key", None)
            if key is not None:
                reason = "prefill does not know this decode instance; handshake first"
                self._send(link, wire.FailMsg(key, wire.Failure("handshake", reason)))
        elif isinstance(msg, wire.RegisterMsg):
            self._apply(self._matcher.register(peer, msg))
            if msg.key in self._hints and peer in self._matcher.registrations(msg.key):
                self._ready_ahead(msg.key, peer, msg)  # prepare() came first
        else:
            log.warning("prefill: unexpected %s from %s", type(msg).__name__, peer)

    def _early_source(self, msg: wire.SourceMsg) -> None:
        """The scheduler's SOURCE: start the push now. Ignored when push() came first (the
        key is pending or has ended): the message is only ever a head start."""
        if msg.key in self._futures or msg.key in self._unclaimed or self._matcher.ended(msg.key):
            return
        source = Source(list(msg.block_ids), msg.num_tokens, msg.first_token)
        future = self._on_source(msg.key, source, sourced=True)
        self._unclaimed[msg.key] = (future, time.monotonic())

    def _from_router(self, msg: Any) -> None:
        if isinstance(msg, wire.SourceMsg):
            self._early_source(msg)
            return
        if not isinstance(msg, wire.AbandonMsg):
            super()._from_router(msg)
            return
        log.debug("prefill: transfer %s abandoned by the router: %s", msg.key, msg.reason)
        abandoned = wire.Failure("abandoned", f"abandoned by the router: {msg.reason}")
        self._on_abort(msg.key, abandoned)

    def _on_hello(self, link: Any, hello: wire.HelloMsg) -> None:
        error = None
        mine = self.config.compat
        if hello.protocol_version != wire.PROTOCOL_VERSION:
            error = (
                f"protocol version mismatch: prefill={wire.PROTOCOL_VERSION} "
                f"decode={hello.protocol_version}"
            )
        elif (diff := hello.compat.mismatch(mine)) is not None:
            error = f"incompatible prefill and decode: {diff}"
        elif hello.layout.shape_key() != self.layout.shape_key():
            error = (
                f"KV layouts cannot be copied: prefill={wire.layout_kind(self.layout)} "
                f"decode={wire.layout_kind(hello.layout)}"
            )
        if error is None:
            old = self._peers.pop(link.address, None)
            if old is not None:
                for key in list(self._hints):  # made ready for the old agent
                    self._forget_ready(key, link.address)
                self.agent.remove_remote(old.agent_name)
            # The same decode rank under a new address: the old one is stale.
            for address, peer in list(self._peers.items()):
                if (peer.engine_id, peer.rank) == (hello.peer.engine_id, hello.peer.rank):
                    why = f"decode {peer.engine_id}/{peer.rank} restarted"
                    self._peer_dead(address, wire.Failure("restarted", why))
            try:
                name = self.agent.add_remote(hello.agent_metadata)
                self._peers[link.address] = _DecodePeer(
                    name, hello.layout, hello.peer.engine_id, hello.peer.rank
                )
                link.peer = hello.peer
            except Exception as e:
                error = f"cannot load decode agent metadata: {e}"
        if error:
            log.warning("prefill: refused handshake from %s: %s", link.address, error)
        self._send(link, wire.HelloAckMsg(self.peer_info, self.layout, error))

    def _apply(self, actions: list[Action]) -> None:
        releases = []
        for action in actions:
            if isinstance(action, Write):
                self._post(action)
            elif isinstance(action, Reply):
                self._reply(action)
            elif isinstance(action, Release):
                releases.append(action)
        # every matcher event comes through here: a key that ended (written, failed,
        # cancelled, aborted, its peer dead) holds nothing made ready for it any longer.
        # Dropped before the releases: a release reads the gauges its caller sees with the
        # push's future, and the engine may step no more after that (a `layered` of 1 left
        # on an idle engine's /metrics otherwise)
        for key in [k for k in self._hints if self._matcher.ended(k)]:
            self._drop_hint(key)
        self._drop_layered()
        for release in releases:
            self._release(release)

    def _reply(self, r: Reply) -> None:
        assert self.channel is not None
        link = self.channel.link(r.peer)
        if r.kind == "fail":
            assert r.failure is not None
            self._send(link, wire.FailMsg(r.key, r.failure))
        elif r.kind == "ack":
            self._send(link, wire.CancelAckMsg(r.key))
        else:
            self._send(link, wire.DoneMsg(r.key))

    def _release(self, r: Release) -> None:
        started = self._started.pop(r.key, time.monotonic())
        num_bytes, num_descs = self._stats.pop(r.key, (0, 0))
        future = self._futures.pop(r.key, None)
        self._gauges = self._read_gauges()  # current before the caller sees the future done
        marks = self._marks.pop(r.key, {})
        fields: dict[str, Any] = {"num_bytes": num_bytes, "num_descs": num_descs, "marks": marks}
        fields["elapsed_s"] = time.monotonic() - started
        if r.failure is None:
            outcome = Outcome(True, **fields)
        else:
            outcome = Outcome.failed(r.failure, **fields)
            log.warning("prefill: transfer %s failed (%s): %s", r.key, r.failure.cause, r.failure)
        if future is not None and not future.done():
            future.set_result(outcome)

    def _post(self, w: Write) -> None:
        pieces = self._pieces_for(w)
        if pieces is not None and pieces.final is None:  # written layer by layer so far
            pieces.final = w
            if pieces.flights or pieces.failure is not None:
                self._settle_pieces(w.key, w.peer, pieces)  # or once they are done
                return
            pieces.settled = True
        peer = self._peers.get(w.peer)
        ahead = self._take_ahead(w)
        rest = self._rest(w, pieces) if pieces is not None and peer is not None else None
        staged, handle = None, (ahead.handle if ahead is not None else None)
        try:
            if peer is None:
                raise RuntimeError(f"decode peer {w.peer} is gone")
            heads = self._heads(w.reg, w.source)
            if rest is not None:  # the regions the pieces have not written
                plan, src, dst = rest
                num_descs, staged_end = plan.num_descs, 0
                handle = self.agent.initialize(
                    "WRITE", peer.agent_name, src, dst, self.layout.mem_type, peer.layout.mem_type
                )
            elif ahead is not None:  # made ready by prepare(): only the post is left
                plan, num_descs, staged_end = ahead.plan, ahead.plan.num_descs, 0
                self.counters["ready_ahead"] += 1
                if w.key in self._marks:
                    self._marks[w.key].setdefault("readied", ahead.ready_s)
            else:
                staged = self._stage(w, peer, heads)
                if staged is None:  # direct: one descriptor per contiguous run of both sides
                    plan, src, dst = self._direct(w.reg, w.source, peer, heads)
                    num_descs, staged_end = plan.num_descs, 0
                else:  # the gathered slot, one descriptor, into decode's slot
                    plan, staged_end = staged.plan, staged.end
                    src = np.array([[staged.addr, staged.size, self.layout.dev_id]], np.uint64)
                    far = [[w.reg.staging_addr, staged.size, peer.layout.dev_id]]
                    dst = np.array(far, dtype=np.uint64)
                    num_descs = 1
                handle = self.agent.initialize(
                    "WRITE", peer.agent_name, src, dst, self.layout.mem_type, peer.layout.mem_type
                )
            if w.key in self._marks:
                self._marks[w.key].setdefault("planned", time.monotonic())
            reg, sent = w.reg, b""
            if self.config.debug_checksum:
                sent = digest(
                    self.layout, w.source.block_ids, reg.num_cached_tokens, reg.num_tokens, heads
                )
            written = wire.WrittenMsg(
                w.key, self.config.rank, sent, w.source.first_token, staged_end
            )
            state = self.agent.start(handle, wire.encode(written))
        except Exception as e:
            if handle is not None:
                self.agent.release(handle)
            if staged is not None:
                self._unstage(staged.addr)
            failure = wire.Failure("write", f"WRITE not posted: {e}")
            self._apply(self._matcher.write_done(w.key, w.peer, failure))
            return
        stats = self._stats.setdefault(w.key, [0, 0])
        stats[0] += plan.total_bytes
        stats[1] += num_descs
        now = time.monotonic()
        slot_addr = None if staged is None else staged.addr
        self._in_flight[(w.key, w.peer)] = _InFlight(
            handle, now, plan.total_bytes, num_descs, slot_addr
        )
        if w.key in self._marks:  # a source this endpoint still holds
            self._marks[w.key].setdefault("posted", now)
        assert self.channel is not None
        self._send(self.channel.link(w.peer), wire.PostedMsg(w.key))
        self._hurry()
        if state == "ERR":
            self._finish_write(w.key, w.peer, "ERR")

    def _heads(self, reg: wire.RegisterMsg, source: Source) -> range:
        """The heads `reg` asks of this rank; raises when this rank cannot write them."""
        heads = range(*reg.heads)
        mine = range(self.layout.first_head, self.layout.first_head + self.layout.num_heads)
        if heads.start < mine.start or heads.stop > mine.stop:
            raise ValueError(f"registered heads {heads} are not held by this rank ({mine})")
        if reg.num_tokens > source.num_tokens:
            raise ValueError(
                f"decode expects {reg.num_tokens} tokens, prefill has {source.num_tokens}"
            )
        return heads

    def _direct(
        self, reg: wire.RegisterMsg, source: Source, peer: _DecodePeer, heads: range
    ) -> tuple[Any, np.ndarray, np.ndarray]:
        """The copy plan of a direct WRITE and its descriptors (prefill's, decode's)."""
        plan = plan_copies(
            self.layout,
            peer.layout,
            source.block_ids,
            reg.block_ids,
            reg.num_cached_tokens,
            reg.num_tokens,
            heads,
            pad_tail=True,
        )
        src, dst = plan.descs(self.layout.dev_id, peer.layout.dev_id)
        return plan, src, dst

    def _wants_staging(
        self, reg: wire.RegisterMsg, source: Source, peer: _DecodePeer, heads: range
    ) -> bool:
        """Whether a push goes through a staging slot when one is free: decode offered a
        slot, this rank has a staging area, and the direct plan would post at least
        staging_min_descs descriptors."""
        if not reg.staging_addr or self.staging is None or self.copier is None:
            return False
        start, end = reg.num_cached_tokens, padded_end(self.layout, peer.layout, reg.num_tokens)
        runs = max(
            _block_runs(source.block_ids, self.layout.block_size, start, end),
            _block_runs(reg.block_ids, peer.layout.block_size, start, end),
        )
        per_run = descs_per_run(self.layout, peer.layout, heads, start, end)
        return runs * per_run >= self.config.staging_min_descs

    def _stage(self, w: Write, peer: _DecodePeer, heads: range) -> _Staged | None:
        """Gather the push into a slot of this rank's staging area (staging.py) when it
        wants staging (above), and return it gathered. None: go direct (no staging here or
        there, few descriptors, no slot free, or the gather failed)."""
        reg = w.reg
        if not self._wants_staging(reg, w.source, peer, heads):
            return None
        assert self.staging is not None and self.copier is not None
        start, end = reg.num_cached_tokens, padded_end(self.layout, peer.layout, reg.num_tokens)
        size = slot_size(peer.layout, heads, start, reg.num_tokens)
        if size > reg.staging_bytes:
            raise ValueError(f"decode's staging slot holds {reg.staging_bytes} B, need {size}")
        addr = self.staging.reserve(size)
        if addr is None:
            self.counters["staging_full"] += 1
            self._fell_back("staged", "full")
            return None
        try:
            stage, ids = slot_layout(addr, peer.layout, heads, start, reg.num_tokens)
            gather = plan_regions(self.layout, stage, w.source.block_ids, ids, start, end, heads)
            self.copier.run(gather)
        except Exception as e:  # nothing reached decode yet: the direct path still can
            self._unstage(addr)
            self.counters["staging_errors"] += 1
            self._fell_back("staged", "error")
            log.warning("prefill: gather for %s failed, writing it direct: %s", w.key, e)
            return None
        self.counters["staged"] += 1
        if w.key in self._marks:
            self._marks[w.key].setdefault("gathered", time.monotonic())
        return _Staged(addr, size, gather, end)

    def _unstage(self, addr: int | None) -> None:
        if addr is not None and self.staging is not None:
            self.staging.release(addr)

    def _drop_flight(self, key: wire.TransferKey, peer: str) -> None:
        flight = self._in_flight.pop((key, peer))
        self.agent.release(flight.handle)
        self._unstage(flight.slot)

    def _progress(self) -> None:
        for (key, peer), flight in list(self._in_flight.items()):
            state = self.agent.state(flight.handle)
            if state != "PROC":
                self._finish_write(key, peer, state)
        if self._computing:
            self._take_computed()
        if self._layered:
            self._progress_pieces()
            self._drop_layered()

    def _finish_write(self, key: wire.TransferKey, peer: str, state: str) -> None:
        self._drop_flight(key, peer)
        if key in self._marks:  # not for a write that ends after its transfer was released
            self._marks[key]["written"] = time.monotonic()
        failure = None if state == "DONE" else wire.Failure("write", f"NIXL WRITE ended {state}")
        self._apply(self._matcher.write_done(key, peer, failure))

    def _peer_dead(self, address: str, failure: wire.Failure) -> None:
        for key, peer in list(self._in_flight):
            if peer == address:
                self._drop_flight(key, peer)
        for lay in self._layered.values():
            pieces = lay.peers.pop(address, None)
            for flight in pieces.flights if pieces is not None else ():
                self.agent.release(flight.handle)
        for key in list(self._hints):
            self._forget_ready(key, address)
        peer_state = self._peers.pop(address, None)
        if peer_state is not None:
            self.agent.remove_remote(peer_state.agent_name)
        self._apply(self._matcher.peer_dead(address, failure))

    def _busy(self) -> bool:
        return bool(self._in_flight or self._computing) or self._pieces_in_flight() > 0

    def _pieces_in_flight(self) -> int:
        return sum(len(p.flights) for lay in self._layered.values() for p in lay.peers.values())

    def _poll_timeout_ms(self) -> int | None:
        if self._busy():
            return BUSY_POLL_MS
        if self._matcher.has_pending() or self._unclaimed or self._hints or self._layered:
            return LEASE_POLL_MS
        expiry_s = self._matcher.next_record_expiry_s()
        if expiry_s is None:
            return None
        return max(LEASE_POLL_MS, int((expiry_s - time.monotonic()) * 1000) + 1)

    def _tick(self, now_s: float) -> None:
        self._apply(self._matcher.expire())
        for key, (_, since_s) in list(self._unclaimed.items()):
            if now_s - since_s > self.config.lease_s:  # its push() never came
                log.warning("prefill: no push() for %s within the lease after its SOURCE", key)
                del self._unclaimed[key]
        for key, hint in list(self._hints.items()):  # prepared, and its push() never came
            if key not in self._futures and now_s - hint.since_s > self.config.lease_s:
                self._drop_hint(key)
        for key, lay in list(self._layered.items()):  # written in part, and no push() came
            if key not in self._futures and now_s - lay.since_s > self.config.lease_s:
                self._fail_pieces(key, wire.Failure("lease", "lease expired: no push() came"))
                if all(p.settled and not p.flights for p in lay.peers.values()):  # else later
                    self._forget_layered(key)
        super()._tick(now_s)

    def _pending_addresses(self) -> set[str]:
        return self._matcher.peers_with_pending()

    def _read_gauges(self) -> dict[str, int]:
        return {
            "pending_match": self._matcher.num_pending_match,
            "registrations": self._matcher.num_registrations,
            "in_flight": len(self._in_flight),
            "held_sources": len(self._futures),
            "unclaimed_sources": len(self._unclaimed),
            "prepared": len(self._hints),
            "layered": len(self._layered),
            "layer_writes_in_flight": self._pieces_in_flight(),
            "cancel_records": self._matcher.num_records,
            "peers": len(self._peers),
            "staging_held_bytes": self.staging.held_bytes if self.staging else 0,
        }

    def _shutdown(self) -> None:
        for key, peer in list(self._in_flight):
            self._drop_flight(key, peer)
        for lay in self._layered.values():
            for pieces in lay.peers.values():
                for flight in pieces.flights:
                    self.agent.release(flight.handle)
        self._layered.clear()
        self._computing.clear()
        for key in list(self._futures):
            self._release(Release(key, wire.Failure("other", "prefill endpoint closed")))
        for key in list(self._hints):
            self._drop_hint(key)
