"""Run one endpoint in a child process over real memory (DRAM, or VRAM on a CUDA GPU),
driven from the parent.

Used by the transfer tests and by `kvpush bench transfer`: prefill and decode must be
separate processes with separate NIXL agents, as they are in production.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvpush.transfer.layout import KVLayout, RegionSpec


@dataclass(frozen=True)
class LayoutSpec:
    """A KVLayout without addresses: the child allocates the memory."""

    num_blocks: int = 64
    block_size: int = 16
    num_heads: int = 2
    head_bytes: int = 32
    head_major: bool = True
    num_regions: int = 2
    first_head: int = 0
    total_heads: int = 0
    num_parts: int = 1
    dim_major_parts: tuple[int, ...] = ()
    elem_bytes: int = 1
    device: str = "cpu"  # or "cuda": the regions are torch tensors on GPU 0
    # block-outer ("cross-layer", vLLM's BLHNC): one buffer holding, block after block,
    # that block of every region side by side
    cross_layer: bool = False

    def build(self, addresses: list[int]) -> KVLayout:
        stride = self.block_bytes * (self.num_regions if self.cross_layer else 1)
        regions = tuple(RegionSpec(a, stride) for a in addresses)
        return KVLayout(
            regions,
            self.num_blocks,
            self.block_size,
            self.num_heads,
            self.head_bytes,
            self.head_major,
            self.first_head,
            self.total_heads,
            num_parts=self.num_parts,
            dim_major_parts=self.dim_major_parts,
            elem_bytes=self.elem_bytes,
            mem_type="DRAM" if self.device == "cpu" else "VRAM",
        )

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_heads * self.num_parts * self.head_bytes

    @property
    def region_num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def fill_pattern(spec: LayoutSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 256, spec.region_num_bytes, dtype=np.uint8) for _ in range(spec.num_regions)
    ]


def host_addresses(arrays: list[np.ndarray]) -> list[int]:
    return [a.ctypes.data for a in arrays]


class Memory:
    """A child's KV regions, filled with a seeded pattern (prefill) or a 0xEE sentinel
    (decode, so stray writes show): numpy arrays in DRAM, or the same bytes on the GPU. A
    cross-layer spec keeps them in one buffer, interleaved block by block; `read()` returns
    each region's bytes apart either way, as the reference expects."""

    def __init__(self, spec: LayoutSpec, seed: int | None) -> None:
        self.spec = spec
        if seed is None:
            host = [np.full(spec.region_num_bytes, 0xEE, np.uint8) for _ in range(spec.num_regions)]
        else:
            host = fill_pattern(spec, seed)
        if spec.cross_layer:  # [block][region][bytes]
            blocks = [h.reshape(spec.num_blocks, spec.block_bytes) for h in host]
            host = [np.stack(blocks, axis=1).reshape(-1)]
        self.cuda = spec.device != "cpu"
        if self.cuda:
            import torch

            torch.cuda.set_device(0)
            self.buffers: list[Any] = [torch.from_numpy(a).to("cuda") for a in host]
            self._scratch = torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
        else:
            self.buffers = host

    def warm(self) -> None:
        """One tiny kernel in this process's CUDA context, waited for. Benchmarks run both
        sides on one GPU, where the first copy after another process used the GPU pays for
        the switch between the two contexts; a serving engine's context is never cold (it
        runs its own forward passes), so timed transfers start from a warm one. No-op on
        DRAM."""
        if self.cuda:
            import torch

            self._scratch.add_(1)
            torch.cuda.synchronize()

    def addresses(self) -> list[int]:
        bases = [b.data_ptr() if self.cuda else b.ctypes.data for b in self.buffers]
        if self.spec.cross_layer:
            return [bases[0] + r * self.spec.block_bytes for r in range(self.spec.num_regions)]
        return bases

    def read(self) -> list[np.ndarray]:
        got = [b.cpu().numpy() if self.cuda else b.copy() for b in self.buffers]
        if not self.spec.cross_layer:
            return got
        spec = self.spec
        blocks = got[0].reshape(spec.num_blocks, spec.num_regions, spec.block_bytes)
        return [blocks[:, r, :].reshape(-1).copy() for r in range(spec.num_regions)]

    def reset(self) -> None:
        for b in self.buffers:
            b.fill_(0xEE) if self.cuda else b.fill(0xEE)


def simulated_forward(
    endpoint: Any, spec: LayoutSpec, key: Any, block_ids: list[int], num_tokens: int,
    layer_s: float, layerwise: bool,
) -> tuple[Any, float]:  # fmt: skip
    """A prefill forward as the connector sees it, for the benchmark and the GPU tests:
    prepare(), then per layer (two regions: K and V) `layer_s` of GPU work (CUDA's sleep
    kernel; a host sleep on DRAM) and, `layerwise`, computed() with that layer's CUDA event
    as its `ready`; then, once the work is done, push() with a first token. Returns the
    push's future and time.monotonic() when the forward's work ended."""
    endpoint.prepare(key, block_ids, num_tokens)
    cuda = spec.device != "cpu"
    if cuda:
        import torch

        cycles = int(layer_s * _sleep_rate())
    for layer in range(spec.num_regions // 2):
        ready = None
        if cuda:
            torch.cuda._sleep(cycles)
            event = torch.cuda.Event()
            event.record()
            ready = event.query
        else:
            time.sleep(layer_s)
        if layerwise:
            endpoint.computed([key], [2 * layer, 2 * layer + 1], ready)
    if cuda:
        torch.cuda.synchronize()
    end = time.monotonic()
    return endpoint.push(key, block_ids, num_tokens, 1), end


_SLEEP_RATE: list[float] = []


def _sleep_rate() -> float:
    """Cycles a second of torch.cuda._sleep on this GPU, measured once."""
    if not _SLEEP_RATE:
        import torch

        torch.cuda._sleep(1_000_000)  # warm
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        stop.record()
        stop.synchronize()
        _SLEEP_RATE.append(20_000_000 / (start.elapsed_time(stop) / 1e3))
    return _SLEEP_RATE[0]


def _child(
    conn: Any, role: str, config: Any, spec: LayoutSpec, seed: int | None, fault: str | None
) -> None:
    from kvpush.transfer.agent import Agent
    from kvpush.transfer.receiver import DecodeEndpoint
    from kvpush.transfer.writer import PrefillEndpoint

    if fault == "register-half":
        # Fault injection: advertise the whole layout but register only its first half with
        # NIXL, so a WRITE into the upper blocks fails inside NIXL.
        register = Agent.register

        def register_half(self: Agent, layout: KVLayout) -> None:
            register(self, msgspec.structs.replace(layout, num_blocks=layout.num_blocks // 2))

        Agent.register = register_half  # type: ignore[method-assign]

    if fault == "gather-fails":
        # Fault injection: every staged copy raises, as a failed kernel launch would.
        from kvpush.transfer.staging import Copier

        def broken(self: Copier, plan: Any) -> None:
            raise RuntimeError("injected: the copy kernel failed")

        Copier.run = broken  # type: ignore[method-assign]
    if fault == "no-staging-memory":
        # Fault injection: the staging area cannot be allocated, as on a full GPU.
        from kvpush.transfer.staging import StagingArea

        def no_memory(self: StagingArea, *args: Any) -> None:
            raise MemoryError("injected: no memory for the staging area")

        StagingArea.__init__ = no_memory  # type: ignore[method-assign,assignment]

    log_dir = os.environ.get("KVPUSH_CHILD_LOG_DIR")
    if log_dir:  # UCX and NIXL print from C: keep their lines per process
        fd = os.open(f"{log_dir}/{role}-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    cls = PrefillEndpoint if role == "prefill" else DecodeEndpoint
    try:
        memory = Memory(spec, seed)
        endpoint: Any = cls(config, spec.build(memory.addresses()))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", endpoint.address))
    futures: dict[int, Any] = {}
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        try:
            if method == "close":
                endpoint.close()
                conn.send(("ok", None))
                break
            if method == "wait":
                fid, timeout_s = args
                result = futures.pop(fid).result(timeout=timeout_s)
            elif method == "done":
                result = futures[args[0]].done()
            elif method in ("gauges", "fallbacks"):
                result = getattr(endpoint, method)()
            elif method == "counters":
                result = dict(getattr(endpoint, "counters", {}))
            elif method == "regions":
                result = memory.read()
            elif method == "timed":  # (future id, seconds the calling thread was held)
                start = time.perf_counter()
                future = getattr(endpoint, args[0])(*args[1:])
                held_s = time.perf_counter() - start
                futures[id(future)] = future
                result = (id(future), held_s)
            elif method == "computed_after":  # computed(), its layers ready only after a
                keys, regions, delay_s = args  # delay, as a GPU's kernels would be
                at = time.monotonic() + delay_s
                future = endpoint.computed(keys, regions, lambda at=at: time.monotonic() >= at)
                futures[id(future)] = future
                result = id(future)
            elif method == "forward":  # (the push's future id, when the forward ended)
                future, end = simulated_forward(endpoint, spec, *args)
                futures[id(future)] = future
                result = (id(future), end)
            elif method == "stall":  # hold the loop thread, as a busy one would be
                stalled = endpoint._call(time.sleep, args[0])
                futures[id(stalled)] = stalled
                result = id(stalled)
            elif method == "reset":
                memory.reset()
                result = None
            elif method == "warm":
                memory.warm()
                result = None
            else:
                future = getattr(endpoint, method)(*args)
                if future is not None:
                    futures[id(future)] = future
                    result = id(future)
                else:
                    result = None
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Side:
    """Parent's handle on an endpoint running in a child process."""

    def __init__(
        self,
        role: str,
        config: Any,
        spec: LayoutSpec,
        seed: int | None = None,
        fault: str | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.role, self.config, self.spec = role, config, spec
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child, args=(child, role, config, spec, seed, fault), daemon=True
        )
        self.proc.start()
        child.close()
        self.address = self._reply(120)

    def _reply(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.role} child did not answer within {timeout_s} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, method: str, *args: Any, timeout_s: float = 60) -> Any:
        self._conn.send((method, args))
        return self._reply(timeout_s)

    def wait(self, future_id: int, timeout_s: float = 30) -> Any:
        return self.call("wait", future_id, timeout_s, timeout_s=timeout_s + 5)

    def kill(self) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(RuntimeError, TimeoutError, OSError, EOFError):
                self.call("close", timeout_s=15)
            self.proc.join(timeout=10)
        self.kill()
