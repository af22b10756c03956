"""An in-memory transport with the methods of kvpush.transfer.agent.Agent, for fast tests.

Agents live in one process and find each other by name. A WRITE checks what NIXL checks
(the peer is known, every descriptor lies inside memory registered on its side) when it is
made ready, then copies its rows with memmove and delivers its notification the first time
its state is polled after the post, as a WRITE in flight completes on a later progress call.
No background thread: progress is made only when the endpoint's loop thread polls, as with
NIXL's progress thread off.

It proves the endpoints' and the connector's logic, never the wire: every behaviour shown
here is also shown over NIXL and UCX (tests/transfer, tests/e2e).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from kvpush.transfer.layout import KVLayout

_AGENTS: dict[str, MemoryAgent] = {}
_LOCK = threading.Lock()


@dataclass
class _Xfer:
    remote: str
    rows: list[tuple[int, int, int]]  # (local addr, remote addr, bytes)
    notif: bytes = b""
    posted: bool = False
    state: str = "PROC"


class MemoryAgent:
    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",)) -> None:
        self.name = name
        self._areas: list[tuple[int, int]] = []  # registered [start, end)
        self._remotes: set[str] = set()
        self._inbox: dict[str, list[bytes]] = {}
        self.fail_writes = False  # a fault: every WRITE posted from here ends in ERR
        with _LOCK:
            _AGENTS[name] = self

    def register(self, layout: KVLayout) -> None:
        for r in layout.regions:
            self._areas.append((r.base_addr, r.base_addr + layout.region_num_bytes))

    def register_area(self, addr: int, num_bytes: int, mem_type: str, dev_id: int) -> None:
        self._areas.append((addr, addr + num_bytes))

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_remote(self, metadata: bytes) -> str:
        name = metadata.decode()
        with _LOCK:
            if name not in _AGENTS:
                raise RuntimeError(f"no agent named {name}")
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        self._remotes.discard(name)

    def _inside(self, addr: int, num_bytes: int) -> bool:
        return any(s <= addr and addr + num_bytes <= e for s, e in self._areas)

    def initialize(
        self,
        op: str,
        remote: str,
        local_descs: np.ndarray,
        remote_descs: np.ndarray,
        local_mem_type: str,
        remote_mem_type: str,
        notif: bytes = b"",
    ) -> _Xfer:
        if op != "WRITE":
            raise ValueError(f"only WRITE is modelled, not {op}")
        with _LOCK:
            peer = _AGENTS.get(remote) if remote in self._remotes else None
        if peer is None:
            raise RuntimeError(f"remote agent {remote} is not loaded")
        if len(local_descs) != len(remote_descs):
            raise ValueError("descriptor lists differ in length")
        rows = []
        pairs = zip(local_descs.tolist(), remote_descs.tolist(), strict=True)
        for (la, ln, _), (ra, rn, _) in pairs:
            if ln != rn:
                raise ValueError("descriptor lengths differ")
            if not self._inside(la, ln) or not peer._inside(ra, rn):
                raise RuntimeError("NIXL_ERR_NOT_FOUND: a descriptor is not registered")
            rows.append((la, ra, ln))
        return _Xfer(remote, rows, notif)

    def start(self, handle: _Xfer, notif: bytes) -> str:
        if handle.posted:
            raise RuntimeError("a transfer is posted once")
        handle.posted, handle.notif = True, notif
        return "PROC"

    def state(self, handle: _Xfer) -> str:
        if handle.state != "PROC":
            return handle.state
        with _LOCK:
            peer = _AGENTS.get(handle.remote)
        if peer is None or self.fail_writes:
            handle.state = "ERR"
            return "ERR"
        for local, far, num_bytes in handle.rows:
            ctypes.memmove(far, local, num_bytes)
        if handle.notif:
            peer._deliver(self.name, handle.notif)
        handle.state = "DONE"
        return "DONE"

    def _deliver(self, sender: str, notif: bytes) -> None:
        with _LOCK:
            self._inbox.setdefault(sender, []).append(notif)

    def release(self, handle: _Xfer) -> None:
        pass

    def notifs(self) -> dict[str, list[bytes]]:
        with _LOCK:
            inbox, self._inbox = self._inbox, {}
        return inbox

    def close(self) -> None:
        with _LOCK:
            _AGENTS.pop(self.name, None)
        self._remotes.clear()
        self._areas.clear()


def agent(name: str) -> MemoryAgent | None:
    """The live agent called `name` (for a test's faults)."""
    with _LOCK:
        return _AGENTS.get(name)
