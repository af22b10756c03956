"""Thin typed wrapper over one nixl_agent, with NIXL's busy-polling progress thread off.

Exactly one thread (the endpoint's loop thread) calls into an Agent; NIXL runs in its
no-sync mode, and progress is made only when that thread polls.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvpush.transfer.layout import KVLayout

log = logging.getLogger(__name__)


def _nixl_api() -> Any:
    try:
        from nixl import _api  # meta package: picks the CUDA variant
    except ImportError:
        try:
            from nixl_cu13 import _api
        except ImportError:
            from nixl_cu12 import _api
    return _api


class Agent:
    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",)) -> None:
        api = _nixl_api()
        config = api.nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self.name = name
        self._agent = api.nixl_agent(name, config)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(
                f"NIXL backend(s) {missing} unavailable; plugins here: {self._agent.plugin_list}"
            )
        self._reg_descs: list[Any] = []
        self._remotes: set[str] = set()

    def register(self, layout: KVLayout) -> None:
        """Register the layout's memory: each region, or the union of regions that overlap
        (a block-outer layout's regions interleave in one buffer), so that every descriptor
        a copy plan makes, one spanning all regions of a block too, is inside one area."""
        spans = sorted((r.base_addr, r.base_addr + layout.region_num_bytes) for r in layout.regions)
        if layout.tiles_blocks:  # one buffer, even where a single block leaves no overlap
            spans = [(spans[0][0], spans[-1][1])]
        areas = [list(spans[0])]
        for start, end in spans[1:]:
            if start < areas[-1][1]:  # not merely adjacent: two allocations may touch
                areas[-1][1] = max(areas[-1][1], end)
            else:
                areas.append([start, end])
        descs = [(start, end - start, layout.dev_id, "") for start, end in areas]
        self._reg_descs.append(self._agent.register_memory(descs, layout.mem_type))

    def register_area(self, addr: int, num_bytes: int, mem_type: str, dev_id: int) -> None:
        """One more buffer peers may WRITE into or from (a staging area)."""
        self._reg_descs.append(
            self._agent.register_memory([(addr, num_bytes, dev_id, "")], mem_type)
        )

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # the peer may be gone already
                log.debug("remove_remote_agent(%s): %s", name, e)

    def initialize(
        self,
        op: str,
        remote: str,
        local_descs: np.ndarray,
        remote_descs: np.ndarray,
        local_mem_type: str,
        remote_mem_type: str,
        notif: bytes = b"",
    ) -> Any:
        """One WRITE or READ of Nx3 (addr, len, dev) arrays, made ready and not posted:
        `start` posts it (once). Release the handle when it is no longer PROC, or when it is
        never posted."""
        local = self._agent.get_xfer_descs(local_descs, local_mem_type)
        far = self._agent.get_xfer_descs(remote_descs, remote_mem_type)
        return self._agent.initialize_xfer(op, local, far, remote, notif)

    def start(self, handle: Any, notif: bytes) -> str:
        """Post an initialized transfer with `notif` as its notification: "DONE" | "PROC" |
        "ERR"."""
        return self._agent.transfer(handle, notif)

    def prep(self, remote: str | None, descs: np.ndarray, mem_type: str) -> Any:
        """A prepared descriptor list of Nx3 (addr, len, dev): local with remote None, else
        on `remote`. Release it with `release_prepped`."""
        return self._agent.prep_xfer_dlist(remote or "NIXL_INIT_AGENT", descs, mem_type)

    def post_prepped(self, op: str, local: Any, far: Any, indices: np.ndarray) -> tuple[Any, str]:
        """Post a WRITE or READ of the prepared lists' rows `indices` (int32), both sides."""
        handle = self._agent.make_prepped_xfer(op, local, indices, far, indices)
        return handle, self._agent.transfer(handle)

    def release_prepped(self, dlist: Any) -> None:
        self._agent.release_dlist_handle(dlist)

    def state(self, handle: Any) -> str:
        return self._agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:  # a handle still in progress towards a dead peer
            log.warning("release_xfer_handle failed: %s", e)

    def notifs(self) -> dict[str, list[bytes]]:
        return self._agent.get_new_notifs()

    def close(self) -> None:
        for name in list(self._remotes):
            self.remove_remote(name)
        for descs in reversed(self._reg_descs):
            self._agent.deregister_memory(descs)
        self._reg_descs.clear()
