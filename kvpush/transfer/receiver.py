"""Decode endpoint: registers destination blocks with prefill and counts completions.

`expect()` registers a request's blocks with every prefill rank that holds some of this
rank's KV heads, and resolves once each of them has written (one NIXL notification per
prefill rank). A failure resolves it too, but only once no prefill rank can still write:
the others are cancelled and acknowledged first. `cancel()` likewise resolves only when no
prefill rank can write into the blocks: until then they are quarantined.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvpush.transfer import wire
from kvpush.transfer.agent import Agent
from kvpush.transfer.endpoint import (
    BUSY_POLL_MS,
    AgentFactory,
    Endpoint,
    Outcome,
    TransferConfig,
    resolved,
)
from kvpush.transfer.handshake import Link
from kvpush.transfer.layout import KVLayout, digest, plan_regions, rank_heads, writer_heads
from kvpush.transfer.staging import slot_layout, slot_size
from kvpush.transfer.wire import PrefillAddress

log = logging.getLogger(__name__)


_MAX_ENDED = 10_000


@dataclass
class _Expected:
    """Everything decode holds for one transfer, from expect() until no prefill rank can
    write into its blocks any more (`DecodeEndpoint._end`, the one place it ends)."""

    future: Future
    num_blocks: int
    started_s: float
    unsent: dict[str, wire.RegisterMsg]  # by prefill address: waiting for its handshake
    remaining: set[str]  # prefill addresses that have not completed
    rank_address: dict[int, str]
    registrations: dict[int, wire.RegisterMsg]  # by prefill rank
    cancel: Future | None = None
    failure: wire.Failure | None = None
    marks: dict[str, float] = field(default_factory=dict)  # see Outcome.marks
    first_token: int = -1
    engine_id: str | None = None  # the prefill engine the router named: checked in _flush
    slots: list[int] = field(default_factory=list)  # staging slots reserved, freed at the end


class DecodeEndpoint(Endpoint):
    role = "decode"

    def __init__(
        self, config: TransferConfig, layout: KVLayout, agent_factory: AgentFactory = Agent
    ) -> None:
        self._expected: dict[wire.TransferKey, _Expected] = {}
        self._hello_sent: set[str] = set()
        # Keys that ended lately, bounded: a WRITE's notification may still arrive for one of
        # them (prefill's CANCEL_ACK, sent once that WRITE completed, can overtake it).
        self._ended: OrderedDict[wire.TransferKey, None] = OrderedDict()
        # "staged": WRITEs scattered from a staging slot; "staging_full": registrations sent
        # without a slot because none was free
        self.counters = {
            "checksums_ok": 0,
            "checksum_mismatches": 0,
            "announcements": 0,
            "staged": 0,
            "staging_full": 0,
        }
        self.landing = Landing(self)
        super().__init__(config, layout, agent_factory)

    # -- API, any thread ----------------------------------------------------------------
    def expect(
        self,
        key: wire.TransferKey,
        prefill: PrefillAddress,
        block_ids: list[int],
        num_tokens: int,
        num_cached_tokens: int = 0,
    ) -> Future:
        """Register `block_ids` for tokens [num_cached_tokens, num_tokens) of `key`.

        Resolves with Outcome(ok=True) once every expected WRITE has landed."""
        return self._call(
            self._on_expect, key, prefill, list(block_ids), num_tokens, num_cached_tokens
        )

    def cancel(self, key: wire.TransferKey, prefill: PrefillAddress | None = None) -> Future:
        """Give the blocks up. Resolves when no prefill rank can still write into them.

        With `prefill`, a key that was never registered is cancelled there too."""
        return self._call(self._on_cancel, key, prefill)

    # -- loop thread --------------------------------------------------------------------
    def _on_expect(
        self,
        key: wire.TransferKey,
        prefill: PrefillAddress,
        block_ids: list[int],
        num_tokens: int,
        num_cached: int,
    ) -> Future:
        if key in self._expected:
            raise ValueError(f"transfer {key} is already expected")
        if not 0 <= num_cached <= num_tokens:
            raise ValueError(f"num_cached_tokens {num_cached} not in 0..{num_tokens}")
        need = -(-num_tokens // self.layout.block_size) if num_cached < num_tokens else 0
        if len(block_ids) < need:
            raise ValueError(f"{num_tokens} tokens need {need} blocks, got {len(block_ids)}")
        quarantined = self._num_quarantined()
        if quarantined + len(block_ids) > self.config.max_quarantined_blocks:
            raise RuntimeError(f"{quarantined} blocks are quarantined; refusing new transfers")
        total = self.layout.heads_total
        decode_tp = self.config.tp_size
        plan = writer_heads(rank_heads(self.config.rank, decode_tp, total), prefill.tp_size, total)
        # How many decode ranks each prefill rank hears from for this key.
        counts: dict[int, int] = {}
        for d in range(decode_tp):
            for p in writer_heads(rank_heads(d, decode_tp, total), prefill.tp_size, total):
                counts[p] = counts.get(p, 0) + 1
        exp = _Expected(Future(), len(block_ids), time.monotonic(), {}, set(), {}, {})
        exp.engine_id = prefill.engine_id
        exp.marks["expected"] = exp.started_s
        for p_rank, heads in plan.items():
            address = prefill.rank_address(p_rank)
            slot, size = self.landing.reserve_slot(heads, num_cached, num_tokens)
            if slot:
                exp.slots.append(slot)
            reg = wire.RegisterMsg(
                key,
                block_ids,
                num_tokens,
                num_cached,
                (heads.start, heads.stop),
                counts[p_rank],
                slot,
                size,
            )
            exp.rank_address[p_rank] = address
            exp.registrations[p_rank] = reg
            exp.remaining.add(address)
            exp.unsent[address] = reg
        self._expected[key] = exp
        for address in list(exp.unsent):
            self._flush(address)
        return exp.future

    def _flush(self, address: str) -> None:
        """Send the registrations queued for a prefill rank, handshaking first if needed."""
        assert self.channel is not None
        link = self.channel.link(address)
        if link.peer is None or link.dropped:  # never met, or maybe restarted since
            if address not in self._hello_sent:
                hello = wire.HelloMsg(
                    self.peer_info, self.agent.metadata(), self.layout, self.config.compat
                )
                self._send(link, hello)
                self._hello_sent.add(address)
            return
        for key, exp in list(self._expected.items()):
            reg = exp.unsent.pop(address, None)
            if reg is None:
                continue
            if exp.engine_id is not None and exp.engine_id != link.peer.engine_id:
                # Checked for every transfer, not once per link: the link may have been
                # made for another request that named the right engine.
                why = wire.Failure(
                    "handshake",
                    f"wrong prefill engine at {address}: the router named {exp.engine_id!r}, "
                    f"it is {link.peer.engine_id!r}",
                )
                self._complete(key, address, why)
                continue
            # marked before the send: prefill may post the WRITE before this thread runs again
            exp.marks.setdefault("registered", time.monotonic())
            self._send(link, reg)

    def _on_cancel(self, key: wire.TransferKey, prefill: PrefillAddress | None) -> Future:
        exp = self._expected.get(key)
        if exp is None:
            # Never registered: tell the prefill ranks anyway, so they free their blocks
            # now rather than at the lease. Nothing of ours can be written.
            if prefill is not None:
                assert self.channel is not None
                for rank in range(prefill.tp_size):
                    link = self.channel.link(prefill.rank_address(rank))
                    self._send(link, wire.CancelMsg(key))
            return resolved(Outcome(True, "nothing to cancel"))
        if exp.cancel is not None:
            return exp.cancel
        exp.cancel = Future()
        assert self.channel is not None
        for address in list(exp.remaining):
            if exp.unsent.pop(address, None) is not None:  # never reached prefill
                exp.remaining.discard(address)
            else:
                self._send(self.channel.link(address), wire.CancelMsg(key))
        self._end(key, exp, wire.CANCELLED)
        return exp.cancel

    def _receive(self, env: wire.Envelope) -> None:
        link = self._link_for(env)
        msg = env.msg
        if isinstance(msg, wire.HelloAckMsg):
            self._on_hello_ack(link, msg)
        elif isinstance(msg, wire.FailMsg):
            self._complete(msg.key, link.address, msg.failure.within("prefill failed the transfer"))
        elif isinstance(msg, wire.DoneMsg | wire.CancelAckMsg):
            self._complete(msg.key, link.address, None)
        elif isinstance(msg, wire.PostedMsg):
            self.counters["announcements"] += 1
            exp = self._expected.get(msg.key)
            if exp is not None and link.address in exp.remaining:
                exp.marks.setdefault("announced", time.monotonic())
                self._hurry()

    def _on_hello_ack(self, link: Link, ack: wire.HelloAckMsg) -> None:
        self._hello_sent.discard(link.address)
        if ack.error:
            for key, exp in list(self._expected.items()):
                if link.address in exp.unsent:
                    exp.unsent.pop(link.address)
                    refused = wire.Failure("handshake", f"handshake refused: {ack.error}")
                    self._complete(key, link.address, refused)
            return
        link.peer, link.dropped = ack.peer, False
        self._flush(link.address)

    def _progress(self) -> None:
        for sender, payloads in self.agent.notifs().items():
            for payload in payloads:
                try:
                    written = wire.decode_written(payload)
                except Exception:
                    log.warning("decode: malformed notification from %s", sender)
                    continue
                exp = self._expected.get(written.key)
                address = exp.rank_address.get(written.prefill_rank) if exp else None
                if exp is None or address is None:
                    late = written.key in self._ended
                    log.log(
                        logging.DEBUG if late else logging.WARNING,
                        "decode: notification for %s transfer %s",
                        "ended" if late else "unknown",
                        written.key,
                    )
                    continue
                if written.first_token >= 0:
                    exp.first_token = written.first_token
                if written.staged_end and exp.cancel is not None:
                    # given up: the blocks are only quarantined, so nothing is scattered into
                    # them, and there is nothing to check
                    self._complete(written.key, address, None)
                    continue
                self._complete(written.key, address, self.landing.land(exp, written))

    def _complete(self, key: wire.TransferKey, address: str, failure: wire.Failure | None) -> None:
        """One prefill rank is done with `key`: written, acknowledged or failed."""
        exp = self._expected.get(key)
        if exp is None or address not in exp.remaining:
            return
        exp.remaining.discard(address)
        self._end(key, exp, failure)

    def _end(self, key: wire.TransferKey, exp: _Expected, failure: wire.Failure | None) -> None:
        """Fail or finish the transfer; forget it once no prefill rank can still write."""
        if failure and not exp.failure:
            exp.failure = failure
            log.warning("decode: transfer %s failed (%s): %s", key, failure.cause, failure)
        if failure and exp.cancel is None:
            # Failed: prefill ranks that have not answered yet are told to stand down.
            exp.cancel = Future()
            assert self.channel is not None
            for address in list(exp.remaining):
                if exp.unsent.pop(address, None) is not None:
                    exp.remaining.discard(address)
                else:
                    self._send(self.channel.link(address), wire.CancelMsg(key))
        if not exp.remaining:  # no prefill rank can write any more: resolve
            del self._expected[key]
            if self.staging is not None:
                for slot in exp.slots:
                    self.staging.release(slot)
            self._ended[key] = None
            if len(self._ended) > _MAX_ENDED:
                self._ended.popitem(last=False)
            self._gauges = self._read_gauges()  # current before the caller sees it done
            now = time.monotonic()
            exp.marks["notified"] = now
            if not exp.future.done():
                fields: dict[str, Any] = {"elapsed_s": now - exp.started_s, "marks": exp.marks}
                if exp.failure is None:
                    outcome = Outcome(True, first_token=exp.first_token, **fields)
                else:
                    outcome = Outcome.failed(exp.failure, **fields)
                exp.future.set_result(outcome)
            if exp.cancel is not None and not exp.cancel.done():
                exp.cancel.set_result(Outcome(True, "blocks released"))

    def _peer_dead(self, address: str, failure: wire.Failure) -> None:
        """Fail what the peer owed us. After a restart, registrations still queued for the
        handshake go to the new instance; after a death, they fail too."""
        restarted = failure.cause == "restarted"
        if not restarted:
            self._hello_sent.discard(address)
            assert self.channel is not None
            self.channel.link(address).peer = None
        for key, exp in list(self._expected.items()):
            if address in exp.remaining and not (restarted and address in exp.unsent):
                exp.unsent.pop(address, None)
                exp.remaining.discard(address)
                self._end(key, exp, failure)

    def _tick(self, now_s: float) -> None:
        # A safety net only: prefill's lease and liveness end every transfer sooner.
        limit_s = self.config.lease_s + 2 * self.config.dead_after_s
        for key, exp in list(self._expected.items()):
            if exp.cancel is None and now_s - exp.started_s > limit_s:
                silent = wire.Failure("lease", f"no answer from prefill within {limit_s:.0f} s")
                self._end(key, exp, silent)
        super()._tick(now_s)

    def _busy(self) -> bool:
        return bool(self._expected)

    def _poll_timeout_ms(self) -> int | None:
        return BUSY_POLL_MS if self._expected else None

    def _pending_addresses(self) -> set[str]:
        return {a for exp in self._expected.values() for a in exp.remaining}

    def _num_quarantined(self) -> int:
        return sum(e.num_blocks for e in self._expected.values() if e.cancel is not None)

    def _read_gauges(self) -> dict[str, int]:
        # Only transfers that hold decode blocks (a full-hit release holds none).
        waiting = [e for e in self._expected.values() if e.cancel is None and e.num_blocks]
        return {
            "expected": len(waiting),
            "expected_blocks": sum(e.num_blocks for e in waiting),
            "quarantined_blocks": self._num_quarantined(),
            "staging_held_bytes": self.staging.held_bytes if self.staging else 0,
        }

    def _shutdown(self) -> None:
        for key, exp in list(self._expected.items()):
            exp.remaining.clear()
            self._end(key, exp, wire.Failure("other", "decode endpoint closed"))


class Landing:
    """What becomes of a WRITE once it has landed: a staged one is scattered from its slot
    into the blocks (staging.py), and with `debug_checksum` what landed is checked against
    prefill's hash. Also reserves each registration's staging slot."""

    def __init__(self, ep: DecodeEndpoint) -> None:
        self.ep = ep

    def reserve_slot(self, heads: range, num_cached: int, num_tokens: int) -> tuple[int, int]:
        """A staging slot for one registration's tokens and heads: (address, size), or
        (0, 0) when staging is off, there is nothing to write, or no slot is free (prefill
        then writes the blocks directly)."""
        ep = self.ep
        if ep.staging is None or num_cached >= num_tokens:
            return 0, 0
        size = slot_size(ep.layout, heads, num_cached, num_tokens)
        addr = ep.staging.reserve(size)
        if addr is None:
            ep.counters["staging_full"] += 1
            ep._fell_back("staged", "full")
            return 0, 0
        return addr, size

    def land(self, exp: _Expected, written: wire.WrittenMsg) -> wire.Failure | None:
        """A WRITE's notification came: None when its data is whole in the blocks."""
        failure = self._scatter(exp, written) if written.staged_end else None
        return failure or self._verify(exp, written)

    def _scatter(self, exp: _Expected, written: wire.WrittenMsg) -> wire.Failure | None:
        """A staged WRITE landed in this registration's slot: copy it into the blocks, and
        return only once that copy is complete (None), so that vLLM reads whole KV."""
        ep = self.ep
        exp.marks.setdefault("landed", time.monotonic())
        reg = exp.registrations[written.prefill_rank]
        try:
            if not reg.staging_addr or ep.copier is None:
                raise ValueError("prefill staged a WRITE for a registration without a slot")
            heads = range(*reg.heads)
            start = reg.num_cached_tokens
            stage, ids = slot_layout(reg.staging_addr, ep.layout, heads, start, reg.num_tokens)
            plan = plan_regions(
                stage, ep.layout, ids, reg.block_ids, start, written.staged_end, heads
            )
            ep.copier.run(plan)
        except Exception as e:
            return wire.Failure("write", f"scatter from the staging slot failed: {e}")
        ep.counters["staged"] += 1
        return None

    def _verify(self, exp: _Expected, written: wire.WrittenMsg) -> wire.Failure | None:
        """debug_checksum: compare what landed with what prefill hashed; None when equal."""
        ep = self.ep
        if not ep.config.debug_checksum:
            return None
        reg = exp.registrations[written.prefill_rank]
        landed = digest(
            ep.layout, reg.block_ids, reg.num_cached_tokens, reg.num_tokens, range(*reg.heads)
        )
        rank = written.prefill_rank
        if landed == written.digest:
            ep.counters["checksums_ok"] += 1
            log.info("decode: checksum ok for %s from prefill rank %d", written.key, rank)
            return None
        ep.counters["checksum_mismatches"] += 1
        log.error("decode: checksum mismatch for %s from prefill rank %d", written.key, rank)
        return wire.Failure("checksum", f"checksum mismatch for data from prefill rank {rank}")
