"""The loop thread shared by the prefill and decode endpoints.

One named thread owns the NIXL agent and every ZMQ socket of an endpoint; callers only
enqueue commands (and get futures back). The thread polls the side channel with a timeout
chosen by how much is pending (see `PollPolicy`), so an idle endpoint blocks at zero CPU.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvpush.transfer import wire
from kvpush.transfer.agent import Agent
from kvpush.transfer.handshake import Link, SideChannel
from kvpush.transfer.layout import KVLayout
from kvpush.transfer.staging import SLOT_ALIGN, Copier, StagingArea, resolve_staging_bytes

log = logging.getLogger(__name__)

AgentFactory = Callable[[str, tuple[str, ...]], Agent]


# How long the loop may sleep between polls of NIXL. With nothing pending it blocks until
# a message or a command arrives (or the next record expiry), at zero CPU.
BUSY_POLL_MS = 1  # a WRITE in flight or expected: its completion is seen within ~1 ms
LEASE_POLL_MS = 20  # only leases and heartbeats pending: checked every 20 ms
# Right after a WRITE is posted (prefill) or announced (decode, by prefill's POSTED), the
# loop polls every TransferConfig.fast_poll_s for fast_window_s: a small WRITE lands in well
# under 1 ms, and the busy step alone would add up to 1 ms on each side.


@dataclass(frozen=True)
class TransferConfig:
    engine_id: str
    compat: wire.Compat
    rank: int = 0
    tp_size: int = 1
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # prefill: its base port plus rank; 0 picks a free port
    backends: tuple[str, ...] = ("UCX",)
    lease_s: float = 30.0  # prefill frees blocks no decode registered for after this
    dead_after_s: float = 5.0  # a peer silent this long with its connection gone is dead
    heartbeat_s: float = 1.0  # sent to each peer that shares pending transfers
    max_quarantined_blocks: int = 1_000_000  # decode refuses new transfers beyond this
    debug_checksum: bool = False  # both sides hash every transferred token; DRAM only
    fast_poll_s: float = 0.0001  # poll step right after a WRITE is posted; 0: never faster
    fast_window_s: float = 0.005  # how long the fast step lasts after each post
    # staging area for scattered pushes (staging.py), bytes per endpoint: None picks 1 GiB
    # where the KV is in VRAM and none on DRAM; 0 turns staging off
    staging_bytes: int | None = None
    # prefill stages a push whose copy plan would post at least this many descriptors
    # (estimated as block runs x layout.descs_per_run), when both sides have a slot free
    staging_min_descs: int = 512

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id must not be empty")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} is outside TP size {self.tp_size}")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port {self.side_channel_port} is not a port")
        for name in ("lease_s", "dead_after_s", "heartbeat_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.fast_poll_s < BUSY_POLL_MS / 1000:
            raise ValueError(f"fast_poll_s must be in [0, {BUSY_POLL_MS} ms): {self.fast_poll_s}")
        if self.fast_window_s < 0:
            raise ValueError(f"fast_window_s must be >= 0, got {self.fast_window_s}")
        if self.staging_bytes is not None and 0 != self.staging_bytes < SLOT_ALIGN:
            raise ValueError(
                f"staging_bytes must be 0 (off), None (default) or >= {SLOT_ALIGN}, "
                f"got {self.staging_bytes}"
            )
        if self.staging_min_descs < 1:
            raise ValueError(f"staging_min_descs must be >= 1, got {self.staging_min_descs}")
        if self.heartbeat_s * 2 > self.dead_after_s:
            raise ValueError("heartbeat_s must be at most half of dead_after_s")


@dataclass(frozen=True)
class Outcome:
    ok: bool
    reason: str = ""
    num_bytes: int = 0
    num_descs: int = 0
    elapsed_s: float = 0.0
    # time.monotonic() of the transfer's events on the loop thread (the per-request timeline):
    # prefill "handed" ("sourced" too when SOURCE started it), "planned" (first copy plan and
    # descriptors built), "posted" (first WRITE), "written" (last WRITE complete); decode
    # "expected", "registered" (first REGISTER sent), "announced" (first POSTED in),
    # "landed" (first staged WRITE in its slot, before the scatter), "notified" (all WRITEs
    # in, and scattered); prefill "gathered" too when a WRITE was staged
    marks: dict[str, float] = field(default_factory=dict)
    first_token: int = -1  # decode: the token prefill sampled, from the WRITEs' notifications
    cause: str = ""  # when not ok: one of wire.CAUSES

    @classmethod
    def failed(cls, failure: wire.Failure, **fields: Any) -> Outcome:
        return cls(False, failure.reason, cause=failure.cause, **fields)


@dataclass
class _Command:
    fn: Callable[..., Any]
    args: tuple
    future: Future = field(default_factory=Future)


class Endpoint:
    role = "endpoint"

    def __init__(
        self, config: TransferConfig, layout: KVLayout, agent_factory: AgentFactory = Agent
    ) -> None:
        """`agent_factory(name, backends)` makes the transport: NIXL's (agent.Agent) in
        every engine; tests may hand in another with the same methods (an in-memory one)."""
        self.config = config
        self.layout = layout
        self._agent_factory = agent_factory
        self.instance_id = uuid.uuid4().hex
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._closing = False
        self._gauges: dict[str, int] = {}
        self._fallbacks: dict[str, int] = {}  # wire.fallback_key -> times, since the start
        self._pending_links: set[str] = set()
        self._fast_until_s = 0.0  # see _hurry()
        self.channel: SideChannel | None = None
        self.staging: StagingArea | None = None  # and its Copier, when staging is on
        self.copier: Copier | None = None
        self._ready: Future = Future()
        name = f"kvpush-{self.role}-{config.engine_id}-{config.rank}"
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.result()

    # -- called from any thread ---------------------------------------------------------
    def gauges(self) -> dict[str, int]:
        return dict(self._gauges)

    def fallbacks(self) -> dict[str, int]:
        """How often each transfer path fell back to the plain one, since the start."""
        return dict(self._fallbacks)

    def _fell_back(self, path: str, cause: str) -> None:
        key = wire.fallback_key(path, cause)
        self._fallbacks[key] = self._fallbacks.get(key, 0) + 1

    @property
    def address(self) -> str:
        assert self.channel is not None
        return self.channel.address

    def close(self) -> None:
        if self._thread.is_alive():
            self._closing = True
            assert self.channel is not None
            self.channel.wake()
            self._thread.join(timeout=10)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Future:
        cmd = _Command(fn, args)
        if self._closing or not self._thread.is_alive():
            closed = wire.Failure("other", f"{self.role} endpoint is closed")
            cmd.future.set_result(Outcome.failed(closed))
            return cmd.future
        self._commands.put(cmd)
        assert self.channel is not None
        self.channel.wake()
        return cmd.future

    # -- the loop thread ----------------------------------------------------------------
    def _main(self) -> None:
        cfg = self.config
        try:
            self.channel = SideChannel(cfg.side_channel_host, cfg.side_channel_port)
            if self.layout.mem_type == "VRAM":
                _use_cuda_device(self.layout.dev_id)
            agent_name = f"{cfg.engine_id}-{self.role}-{cfg.rank}-{self.instance_id[:8]}"
            self.agent = self._agent_factory(agent_name, cfg.backends)
            self.agent.register(self.layout)
            self._start_staging()
        except Exception as e:
            if self.channel is not None:
                self.channel.close()
            self._ready.set_exception(e)
            return
        self.peer_info = wire.PeerInfo(
            cfg.engine_id, cfg.rank, self.instance_id, self.channel.address, agent_name
        )
        self._gauges = self._read_gauges()
        self._ready.set_result(None)
        try:
            while not self._closing:
                if self._busy() and time.monotonic() < self._fast_until_s:
                    time.sleep(cfg.fast_poll_s)  # releases the GIL, as the poll would
                    envelopes = self.channel.poll(0)
                else:
                    envelopes = self.channel.poll(self._poll_timeout_ms())
                self._run_commands()
                for env in envelopes:
                    if env.reply_to:
                        self._receive(env)
                    else:  # a router: nothing to answer on
                        self._from_router(env.msg)
                self._progress()
                self._tick(time.monotonic())
                self._gauges = self._read_gauges()
        except Exception:
            log.exception("kvpush %s loop crashed", self.role)
            raise
        finally:
            self._shutdown()
            self.agent.close()
            self.channel.close()

    def _start_staging(self) -> None:
        """The staging area, when configured. Without it (no memory for it, no Triton) the
        endpoint still runs, every push direct: staging only ever saves time."""
        lay = self.layout
        size = resolve_staging_bytes(self.config.staging_bytes, lay.mem_type)
        if not size:
            return
        try:
            copier = Copier(lay.mem_type)
            area = StagingArea(size, lay.mem_type, lay.dev_id)
            self.agent.register_area(area.base_addr, size, lay.mem_type, lay.dev_id)
        except Exception as e:
            log.warning(
                "kvpush %s: no staging area (%s: %s); scattered pushes will be slow, one NIXL "
                "descriptor per block run (kv_connector_extra_config.staging_mib: 0 silences "
                "this)",
                self.role,
                type(e).__name__,
                e,
            )
            return
        self.staging, self.copier = area, copier

    def _run_commands(self) -> None:
        done: list[tuple[_Command, Any]] = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            try:
                done.append((cmd, cmd.fn(*cmd.args)))
            except Exception as e:  # a bad request fails alone; the loop goes on
                log.warning("kvpush %s: %s", self.role, e)
                done.append((cmd, Outcome.failed(wire.Failure("other", str(e)))))
        if not done:
            return
        self._gauges = self._read_gauges()  # current before any caller sees its command done
        for cmd, result in done:
            if isinstance(result, Future):
                result.add_done_callback(partial(_chain, dst=cmd.future))
            else:
                cmd.future.set_result(result)

    def _hurry(self) -> None:
        """A WRITE was just posted: poll at the fast step for the next fast_window_s."""
        if self.config.fast_poll_s > 0:
            self._fast_until_s = time.monotonic() + self.config.fast_window_s

    def _send(self, link: Link, msg: Any) -> None:
        assert self.channel is not None
        self.channel.send(link, self.instance_id, msg)

    def _tick(self, now_s: float) -> None:
        """Heartbeat every peer that shares pending work; declare the dead ones dead."""
        assert self.channel is not None
        pending = self._pending_addresses()
        for address in pending:
            link = self.channel.link(address)
            if address not in self._pending_links:
                link.last_seen_s = max(link.last_seen_s, now_s)  # silence counts from here
            if now_s - link.last_sent_s >= self.config.heartbeat_s:
                self._send(link, wire.HeartbeatMsg())
            if self.channel.is_dead(link, self.config.dead_after_s):
                dead = wire.Failure(
                    "dead",
                    f"peer at {address} is dead: silent for {self.config.dead_after_s:.0f} s "
                    "and its connection is gone",
                )
                log.warning("kvpush %s: %s", self.role, dead)
                self._peer_dead(address, dead)
        self._pending_links = pending

    def _link_for(self, env: wire.Envelope) -> Link:
        """The link to a message's sender; a new instance at a known address is a restart."""
        assert self.channel is not None
        link = self.channel.link(env.reply_to)
        link.last_seen_s = time.monotonic()
        if link.peer is not None and link.peer.instance_id != env.sender:
            self._peer_dead(
                env.reply_to, wire.Failure("restarted", f"peer at {env.reply_to} restarted")
            )
            link.peer = None
        return link

    # -- for subclasses -----------------------------------------------------------------
    def _poll_timeout_ms(self) -> int | None:
        raise NotImplementedError

    def _busy(self) -> bool:
        """Whether a WRITE this endpoint waits for may complete (polled at the busy step)."""
        raise NotImplementedError

    def _receive(self, env: wire.Envelope) -> None:
        raise NotImplementedError

    def _from_router(self, msg: Any) -> None:
        log.warning("kvpush %s: dropped %s without a reply address", self.role, type(msg).__name__)

    def _progress(self) -> None:
        raise NotImplementedError

    def _pending_addresses(self) -> set[str]:
        raise NotImplementedError

    def _peer_dead(self, address: str, failure: wire.Failure) -> None:
        """The peer is gone (cause "dead") or came back as a new instance ("restarted")."""
        raise NotImplementedError

    def _read_gauges(self) -> dict[str, int]:
        raise NotImplementedError

    def _shutdown(self) -> None:
        raise NotImplementedError


def resolved(outcome: Outcome) -> Future:
    future: Future = Future()
    future.set_result(outcome)
    return future


def _chain(src: Future, dst: Future) -> None:
    if not dst.done():
        dst.set_result(src.result())


def _use_cuda_device(dev_id: int) -> None:
    """UCX's CUDA transports act in the calling thread's current CUDA context: make it the
    loop thread's, on the device the KV cache lives on, before NIXL registers or posts."""
    import torch

    torch.cuda.set_device(dev_id)
