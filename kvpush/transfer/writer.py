"""Prefill endpoint: the background writer that pushes finished prefills into decode blocks.

The caller (vLLM's worker, or a test) calls `push()` when a request's prefill is done and
gets a future that resolves when its blocks may be freed. Everything else happens on the
loop thread: handshakes, matching (matcher.py), descriptor builds, WRITE posts, completion.

Each key has one record (`paths.Transfer`) from its first sign to its end; the paths a push
can take besides the plain one (made ready ahead, layer by layer, staged) are small
collaborators in paths.py. `_settle` is the one place a record ends.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvpush.transfer import wire
from kvpush.transfer.agent import Agent
from kvpush.transfer.endpoint import (
    BUSY_POLL_MS,
    LEASE_POLL_MS,
    AgentFactory,
    Endpoint,
    Outcome,
    TransferConfig,
    resolved,
)
from kvpush.transfer.layout import KVLayout, digest
from kvpush.transfer.matcher import Action, Matcher, Release, Reply, Source, Write
from kvpush.transfer.paths import (
    DecodePeer,
    Hint,
    InFlight,
    LayerByLayer,
    Plans,
    ReadyAhead,
    Staged,
    Transfer,
    record_gauges,
)

log = logging.getLogger(__name__)


class PrefillEndpoint(Endpoint):
    role = "prefill"

    def __init__(
        self, config: TransferConfig, layout: KVLayout, agent_factory: AgentFactory = Agent
    ) -> None:
        self.matcher = Matcher(config.lease_s)
        self.peers: dict[str, DecodePeer] = {}  # by decode side-channel address
        self.transfers: dict[wire.TransferKey, Transfer] = {}
        self.plans = Plans(self)
        self.ahead = ReadyAhead(self)
        self.layers = LayerByLayer(self)
        self.writes = Writes(self)
        self.handshakes = Handshakes(self)
        # WRITEs gathered through a staging slot, and WRITEs sent direct because this rank's
        # staging area had no slot free or the gather failed; WRITEs posted as prepare()
        # made them ready; pushes written layer by layer, and their WRITEs posted before
        # the push
        self.counters = {
            "staged": 0,
            "staging_full": 0,
            "staging_errors": 0,
            "ready_ahead": 0,
            "layered": 0,
            "layer_writes": 0,
        }
        super().__init__(config, layout, agent_factory)

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
        return self._call(self.layers.computed, keys, regions, ready)

    def abort(self, key: wire.TransferKey, failure: wire.Failure) -> Future:
        """The prefill request failed or was aborted: tell decode, hold nothing. Resolves
        once the loop thread has acted on it (and refreshed the gauges)."""
        return self._call(self._on_abort, key, failure)

    # -- a transfer's record: begun, ended ------------------------------------------------
    def _record(self, key: wire.TransferKey) -> Transfer:
        rec = self.transfers.get(key)
        if rec is None:
            rec = self.transfers[key] = Transfer(key)
        return rec

    def _settle(self, rec: Transfer) -> None:
        """The one place a record ends: once its key has ended (written, failed, cancelled,
        aborted, its peer dead), nothing made ready for it is held, its pieces are dropped
        once none is on the wire, and the record goes when it holds nothing."""
        if self.matcher.ended(rec.key):
            self.ahead.drop(rec)
            if rec.layered is not None and not rec.layered.in_flight():
                rec.layered = None
        if rec.idle() and self.transfers.get(rec.key) is rec:
            del self.transfers[rec.key]

    def _settle_all(self) -> None:
        for rec in list(self.transfers.values()):
            self._settle(rec)

    # -- loop thread --------------------------------------------------------------------
    def _on_source(self, key: wire.TransferKey, source: Source, sourced: bool = False) -> Future:
        rec = self._record(key)
        if rec.unclaimed_s is not None and rec.future is not None:  # SOURCE started it
            rec.unclaimed_s = None
            return rec.future
        if rec.holding:
            failure = wire.Failure("other", f"transfer {key} is already being pushed")
            return resolved(Outcome.failed(failure))
        if rec.released:  # pushed before, and released: this is a push of its own
            rec.num_bytes = rec.num_descs = 0
        future: Future = Future()
        rec.future, rec.released, rec.started_s = future, False, time.monotonic()
        rec.marks = {"handed": rec.started_s}
        if sourced:  # from the scheduler's SOURCE, ahead of push(): held for push()
            rec.marks["sourced"] = rec.unclaimed_s = rec.started_s
        if rec.layered is not None and rec.layered.first_s:  # layers written before it
            rec.marks["layered"] = rec.layered.first_s
        self.apply(self.matcher.source_ready(key, source))
        return future

    def _on_prepare(self, key: wire.TransferKey, source: Source) -> None:
        rec = self.transfers.get(key)
        if self.matcher.ended(key) or (
            rec is not None and (rec.holding or rec.layered is not None)
        ):
            return  # push() came first, the transfer has ended, or it is being written
        rec = self._record(key)
        self.ahead.drop(rec)  # the request was scheduled again (preempted): the new blocks
        rec.hint = Hint(source, time.monotonic())
        for peer, reg in self.matcher.registrations(key).items():
            self.ahead.make(rec, peer, reg)

    def _on_abort(self, key: wire.TransferKey, failure: wire.Failure) -> None:
        self.apply(self.matcher.abort(key, failure))
        rec = self.transfers.get(key)
        if rec is not None:
            self.layers.fail(rec, failure)
            self._settle(rec)

    def _receive(self, env: wire.Envelope) -> None:
        link = self._link_for(env)
        msg, peer = env.msg, env.reply_to
        if isinstance(msg, wire.HelloMsg):
            self.handshakes.hello(link, msg)
        elif isinstance(msg, wire.HeartbeatMsg):
            pass
        elif isinstance(msg, wire.CancelMsg):  # needs no handshake: it only frees
            rec = self.transfers.get(msg.key)
            if rec is not None:
                self.ahead.forget(rec, peer)
            self.apply(self.matcher.cancel(peer, msg.key))
            if rec is not None:
                self.layers.fail(rec, wire.CANCELLED, peer)  # answered once they are done
                self._settle(rec)
        elif peer not in self.peers or link.peer is None:
            key = getattr(msg, "key", None)
            if key is not None:
                reason = "prefill does not know this decode instance; handshake first"
                self._send(link, wire.FailMsg(key, wire.Failure("handshake", reason)))
        elif isinstance(msg, wire.RegisterMsg):
            self.apply(self.matcher.register(peer, msg))
            rec = self.transfers.get(msg.key)
            if rec is not None and peer in self.matcher.registrations(msg.key):
                self.ahead.make(rec, peer, msg)  # prepare() came first
        else:
            log.warning("prefill: unexpected %s from %s", type(msg).__name__, peer)

    def _early_source(self, msg: wire.SourceMsg) -> None:
        """The scheduler's SOURCE: start the push now. Ignored when push() came first (the
        key is pending or has ended): the message is only ever a head start."""
        rec = self.transfers.get(msg.key)
        if self.matcher.ended(msg.key) or (
            rec is not None and (rec.holding or rec.unclaimed_s is not None)
        ):
            return
        source = Source(list(msg.block_ids), msg.num_tokens, msg.first_token)
        self._on_source(msg.key, source, sourced=True)

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

    def apply(self, actions: list[Action]) -> None:
        """Carry out the matcher's actions. The releases go last, after every ended key's
        record is settled: a release reads the gauges its caller sees with the push's future,
        and the engine may step no more after that (a `layered` of 1 left on an idle engine's
        /metrics otherwise)."""
        releases = []
        for action in actions:
            if isinstance(action, Write):
                self.post(action)
            elif isinstance(action, Reply):
                self._reply(action)
            elif isinstance(action, Release):
                releases.append(action)
        self._settle_all()
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
        rec = self.transfers.get(r.key)
        if rec is None or not rec.holding:
            return
        future = rec.future
        assert future is not None
        rec.released = True
        fields: dict[str, Any] = {
            "num_bytes": rec.num_bytes,
            "num_descs": rec.num_descs,
            "marks": rec.marks,
            "elapsed_s": time.monotonic() - rec.started_s,
        }
        self._settle(rec)
        self._gauges = self._read_gauges()  # current before the caller sees the future done
        if r.failure is None:
            outcome = Outcome(True, **fields)
        else:
            outcome = Outcome.failed(r.failure, **fields)
            log.warning("prefill: transfer %s failed (%s): %s", r.key, r.failure.cause, r.failure)
        if not future.done():
            future.set_result(outcome)

    def post(self, w: Write) -> None:
        """Post the push's WRITE to one decode rank (a matcher's Write, or a held one)."""
        self.writes.post(self._record(w.key), w)

    def announce(self, w: Write) -> None:
        """Tell decode the WRITE is posted: it polls faster until it lands."""
        assert self.channel is not None
        self._send(self.channel.link(w.peer), wire.PostedMsg(w.key))
        self._hurry()

    def _progress(self) -> None:
        self.writes.progress()
        if self.layers.waiting:
            self.layers.take_computed()
        if any(r.layered is not None for r in self.transfers.values()):
            self.layers.progress()
            self._settle_all()

    def _peer_dead(self, address: str, failure: wire.Failure) -> None:
        self.handshakes.dead(address, failure)

    def _busy(self) -> bool:
        return self.layers.waiting or any(
            r.flights or (r.layered is not None and r.layered.in_flight())
            for r in self.transfers.values()
        )

    def _poll_timeout_ms(self) -> int | None:
        if self._busy():
            return BUSY_POLL_MS
        if self.matcher.has_pending() or self.transfers:
            return LEASE_POLL_MS
        expiry_s = self.matcher.next_record_expiry_s()
        if expiry_s is None:
            return None
        return max(LEASE_POLL_MS, int((expiry_s - time.monotonic()) * 1000) + 1)

    def _tick(self, now_s: float) -> None:
        self.apply(self.matcher.expire())
        lease_s = self.config.lease_s
        for rec in list(self.transfers.values()):
            if rec.unclaimed_s is not None and now_s - rec.unclaimed_s > lease_s:
                log.warning("prefill: no push() for %s within the lease after its SOURCE", rec.key)
                rec.unclaimed_s = None
            if not rec.holding and rec.hint and now_s - rec.hint.since_s > lease_s:
                self.ahead.drop(rec)  # prepared, and its push() never came
            if not rec.holding and rec.layered and now_s - rec.layered.since_s > lease_s:
                self.layers.expire(rec)  # written in part, and no push() came
            self._settle(rec)
        super()._tick(now_s)

    def _pending_addresses(self) -> set[str]:
        return self.matcher.peers_with_pending()

    def _read_gauges(self) -> dict[str, int]:
        return {
            "pending_match": self.matcher.num_pending_match,
            "registrations": self.matcher.num_registrations,
            **record_gauges(self.transfers.values()),
            "cancel_records": self.matcher.num_records,
            "peers": len(self.peers),
            "staging_held_bytes": self.staging.held_bytes if self.staging else 0,
        }

    def _shutdown(self) -> None:
        closed = wire.Failure("other", "prefill endpoint closed")
        for rec in list(self.transfers.values()):
            for peer in list(rec.flights):
                self.writes.drop(rec, peer)
            self.layers.close(rec)
            self._release(Release(rec.key, closed))
            self.ahead.drop(rec)
        self.transfers.clear()


class Writes:
    """The push's WRITE to each decode rank: posted from what the paths left (the rest of a
    rank written layer by layer, the WRITE made ready ahead) or planned now (staged or
    direct), then watched until NIXL says it is done."""

    def __init__(self, ep: PrefillEndpoint) -> None:
        self.ep = ep

    def post(self, rec: Transfer, w: Write) -> None:
        ep = self.ep
        pieces, wait = ep.layers.hold_final(rec, w)
        if wait:
            return
        peer = ep.peers.get(w.peer)
        ahead = ep.ahead.take(rec, w)
        rest = None
        if pieces is not None and peer is not None:
            rest = ep.layers.rest(rec, w, pieces, peer)
        staged: Staged | None = None
        handle = ahead.handle if ahead is not None else None
        try:
            if peer is None:
                raise RuntimeError(f"decode peer {w.peer} is gone")
            heads = ep.plans.heads(w.reg, w.source)
            if rest is not None:  # the regions the pieces have not written
                plan, src, dst = rest
                num_descs, staged_end = plan.num_descs, 0
                handle = self._initialize(peer, src, dst)
            elif ahead is not None:  # made ready by prepare(): only the post is left
                plan, num_descs, staged_end = ahead.plan, ahead.plan.num_descs, 0
                ep.counters["ready_ahead"] += 1
                rec.mark("readied", ahead.ready_s)
            else:
                staged = ep.plans.stage(rec, w, peer, heads)
                if staged is None:  # direct: one descriptor per contiguous run of both sides
                    plan, src, dst = ep.plans.direct(w.reg, w.source, peer, heads)
                    num_descs, staged_end = plan.num_descs, 0
                else:  # the gathered slot, one descriptor, into decode's slot
                    plan, staged_end = staged.plan, staged.end
                    src = np.array([[staged.addr, staged.size, ep.layout.dev_id]], np.uint64)
                    far = [[w.reg.staging_addr, staged.size, peer.layout.dev_id]]
                    dst = np.array(far, dtype=np.uint64)
                    num_descs = 1
                handle = self._initialize(peer, src, dst)
            rec.mark("planned")
            state = ep.agent.start(handle, self._written(w, heads, staged_end))
        except Exception as e:
            if handle is not None:
                ep.agent.release(handle)
            ep.plans.unstage(staged.addr if staged is not None else None)
            failure = wire.Failure("write", f"WRITE not posted: {e}")
            ep.apply(ep.matcher.write_done(w.key, w.peer, failure))
            return
        rec.count(plan.total_bytes, num_descs)
        now = time.monotonic()
        slot = None if staged is None else staged.addr
        rec.flights[w.peer] = InFlight(handle, now, plan.total_bytes, num_descs, slot)
        rec.mark("posted", now)
        ep.announce(w)
        if state == "ERR":
            self.finish(rec, w.peer, "ERR")

    def _initialize(self, peer: DecodePeer, src: np.ndarray, dst: np.ndarray) -> Any:
        lay = self.ep.layout
        return self.ep.agent.initialize(
            "WRITE", peer.agent_name, src, dst, lay.mem_type, peer.layout.mem_type
        )

    def _written(self, w: Write, heads: range, staged_end: int) -> bytes:
        """The WRITE's notification: what decode needs to accept it."""
        ep, reg, sent = self.ep, w.reg, b""
        if ep.config.debug_checksum:
            ids = w.source.block_ids
            sent = digest(ep.layout, ids, reg.num_cached_tokens, reg.num_tokens, heads)
        written = wire.WrittenMsg(w.key, ep.config.rank, sent, w.source.first_token, staged_end)
        return wire.encode(written)

    def drop(self, rec: Transfer, peer: str) -> None:
        """The WRITE to `peer` is off the wire, or never to be waited for: release it."""
        flight = rec.flights.pop(peer)
        self.ep.agent.release(flight.handle)
        self.ep.plans.unstage(flight.slot)

    def progress(self) -> None:
        for rec in [r for r in self.ep.transfers.values() if r.flights]:
            for peer, flight in list(rec.flights.items()):
                state = self.ep.agent.state(flight.handle)
                if state != "PROC":
                    self.finish(rec, peer, state)

    def finish(self, rec: Transfer, peer: str, state: str) -> None:
        self.drop(rec, peer)
        rec.mark("written", first=False)  # the last WRITE's completion
        failure = None if state == "DONE" else wire.Failure("write", f"NIXL WRITE ended {state}")
        self.ep.apply(self.ep.matcher.write_done(rec.key, peer, failure))


class Handshakes:
    """Decode ranks met: a HELLO accepted (or refused, saying why) makes a peer whose WRITEs
    this rank may post; a peer restarted or dead takes down what was on its way to it."""

    def __init__(self, ep: PrefillEndpoint) -> None:
        self.ep = ep

    def hello(self, link: Any, hello: wire.HelloMsg) -> None:
        ep = self.ep
        error = wire.refusal(hello, ep.config.compat, ep.layout)
        if error is None:
            old = ep.peers.pop(link.address, None)
            if old is not None:
                for rec in ep.transfers.values():  # made ready for the old agent
                    ep.ahead.forget(rec, link.address)
                ep.agent.remove_remote(old.agent_name)
            # The same decode rank under a new address: the old one is stale.
            for address, peer in list(ep.peers.items()):
                if (peer.engine_id, peer.rank) == (hello.peer.engine_id, hello.peer.rank):
                    why = f"decode {peer.engine_id}/{peer.rank} restarted"
                    self.dead(address, wire.Failure("restarted", why))
            try:
                name = ep.agent.add_remote(hello.agent_metadata)
                ep.peers[link.address] = DecodePeer(
                    name, hello.layout, hello.peer.engine_id, hello.peer.rank
                )
                link.peer = hello.peer
            except Exception as e:
                error = f"cannot load decode agent metadata: {e}"
        if error:
            log.warning("prefill: refused handshake from %s: %s", link.address, error)
        ep._send(link, wire.HelloAckMsg(ep.peer_info, ep.layout, error))

    def dead(self, address: str, failure: wire.Failure) -> None:
        """The peer at `address` died or restarted: its WRITEs, pieces and WRITEs made ready
        are released, and the matcher fails or re-pairs what it owed."""
        ep = self.ep
        for rec in list(ep.transfers.values()):
            if address in rec.flights:
                ep.writes.drop(rec, address)
            ep.layers.drop_peer(rec, address)
            ep.ahead.forget(rec, address)
        peer_state = ep.peers.pop(address, None)
        if peer_state is not None:
            ep.agent.remove_remote(peer_state.agent_name)
        ep.apply(ep.matcher.peer_dead(address, failure))
