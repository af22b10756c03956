"""The engines behind the proxy: one pooled HTTP client each, health, load, and selection."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from functools import partial

import aiohttp

from kvpush import httpclient
from kvpush.asgi import LIMITS_PATH
from kvpush.proxy import paths
from kvpush.proxy.config import EngineState, ProxyConfig
from kvpush.proxy.errors import ProxyError

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 10.0  # a loaded 2-core host can take seconds to answer


ADMIT_SHARE = 0.9  # of a decode engine's KV cache that requests in flight may hold


class Full(ProxyError):
    """Every healthy engine of a role is at its bound (`EnginePool.has_room`)."""


class EnginePool:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.states = [EngineState(info) for info in config.engines]
        self._clients: dict[str, aiohttp.ClientSession] = {}
        self._turn = {role: itertools.count() for role in ("prefill", "decode")}
        self._health_task: asyncio.Task | None = None
        self._freed = asyncio.Event()  # set when an engine's count falls (`admit`)

    async def start(self) -> None:
        for s in self.states:
            self._clients[s.info.url] = httpclient.session(
                1024,
                self.config.request_timeout_s,
                self.config.connect_timeout_s,
                base_url=s.info.url,
                on_connect=partial(self._connected, s),
            )
        await self.check_health()
        names = {tuple(s.served_models) for s in self.states if s.served_models}
        if len(names) > 1:
            await self.stop()
            detail = "; ".join(f"{s.info.url} serves {s.served_models}" for s in self.states)
            raise RuntimeError(f"engines serve different models: {detail}")
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    @staticmethod
    def _connected(state: EngineState) -> None:
        state.connections_opened += 1

    def client(self, state: EngineState) -> aiohttp.ClientSession:
        return self._clients[state.info.url]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(s) for s in self.states))
        served = [tuple(s.served_models) for s in self.states if s.healthy and s.served_models]
        if len(set(served)) > 1:
            detail = "; ".join(f"{s.info.url} serves {s.served_models}" for s in self.states)
            log.error("served-model-name mismatch: %s", detail)
            for s in self.states:
                s.error = f"served-model-name mismatch: {detail}"

    async def _check(self, s: EngineState) -> None:
        client = self._clients[s.info.url]
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        try:
            async with client.get("/health", timeout=timeout) as r:
                r.raise_for_status()
            if not s.healthy or s.missed_checks or not s.served_models:
                # the names change only with a restart, which a check sees fail first
                async with client.get("/v1/models", timeout=timeout) as r:
                    r.raise_for_status()
                    s.served_models = [m["id"] for m in (await r.json())["data"]]
            if s.kv_capacity_tokens is None:
                s.kv_capacity_tokens = await self._kv_capacity(client, timeout)
            if s.max_num_seqs is None:
                s.max_num_seqs = await self._max_num_seqs(client, timeout)
            if not s.healthy:
                log.info("engine %s is healthy again", s.info.url)
            if s.down.is_set():
                s.down = asyncio.Event()
            s.healthy, s.error = True, ""
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            # A busy engine can miss one check; a refused connection or three misses in a
            # row take it out of rotation.
            s.missed_checks += 1
            s.error = f"{type(e).__name__}: {e}"
            refused = isinstance(e, aiohttp.ClientConnectorError)
            if s.healthy and (refused or s.missed_checks >= 3):
                log.warning("engine %s is unhealthy: %s", s.info.url, s.error)
                s.healthy = False
                s.down.set()
            return
        s.missed_checks = 0

    @staticmethod
    async def _kv_capacity(client: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout) -> int:
        """The engine's KV cache in tokens (vLLM's `vllm:cache_config_info`: blocks x block
        size); 0 where its /metrics does not say (then no bound is derived from it)."""
        from prometheus_client.parser import text_string_to_metric_families

        async with client.get("/metrics", timeout=timeout) as r:
            if r.status != 200:
                return 0
            text = await r.text()
        for family in text_string_to_metric_families(text):
            if family.name != "vllm:cache_config_info":
                continue
            for sample in family.samples:
                blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if blocks and size and blocks.isdigit() and size.isdigit():
                    return int(blocks) * int(size)
        return 0

    @staticmethod
    async def _max_num_seqs(client: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout) -> int:
        """The requests the engine runs at once (`GET /kvpush/limits`, kvpush.vllm.validate);
        0 where it does not say (a plain vLLM engine: no bound derived from it)."""
        async with client.get(LIMITS_PATH, timeout=timeout) as r:
            if r.status != 200:
                return 0
            return int((await r.json()).get("max_num_seqs", 0))

    def request_room(self, s: EngineState) -> int | None:
        """The requests an engine may hold in flight (prefill legs and whole requests on a
        prefill engine); None: no bound."""
        configured = (
            self.config.max_decode_requests
            if s.info.role == "decode"
            else self.config.max_prefill_requests
        )
        return configured if configured is not None else s.max_num_seqs or None

    def room(self, s: EngineState) -> int | None:
        """The prompt tokens a decode engine may hold for requests in flight; None: no bound
        (and none on a prefill engine, whose KV a request holds only until it is pushed)."""
        if s.info.role != "decode":
            return None
        if self.config.max_decode_prompt_tokens is not None:
            return self.config.max_decode_prompt_tokens
        return int(ADMIT_SHARE * s.kv_capacity_tokens) if s.kv_capacity_tokens else None

    def has_room(self, s: EngineState, prompt_tokens: int) -> bool:
        room, requests = self.room(s), self.request_room(s)
        return (room is None or s.outstanding_tokens + prompt_tokens <= room) and (
            requests is None or s.outstanding < requests
        )

    async def admit(self, prompt_tokens: int, hashes: tuple[int, ...] = ()) -> EngineState:
        """A decode engine for a request, as `pick`; while every healthy one is full (`room`),
        waiting up to `admission_wait_s` for one to free room, then 503 with Retry-After."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.admission_wait_s
        while True:
            try:
                return self.pick("decode", prompt_tokens, hashes=hashes)
            except Full:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise
                self._freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), remaining)

    def mark_failed(self, state: EngineState, error: BaseException) -> None:
        """The connection to this engine was refused or lost: skip it until a health check
        passes."""
        if state.healthy:
            log.warning("engine %s failed a request: %r; out of rotation", state.info.url, error)
        state.healthy, state.error = False, f"{type(error).__name__}: {error}"
        state.down.set()

    def healthy(self, but: EngineState | None = None) -> list[EngineState]:
        """The healthy engines of either role, less `but`."""
        return [s for s in self.states if s.healthy and s is not but]

    def has_healthy(self, role: str) -> bool:
        return any(s.healthy and s.info.role == role for s in self.states)

    def models(self) -> list[str]:
        for s in self.states:
            if s.healthy and s.served_models:
                return list(s.served_models)
        return []

    def pick_healthy(
        self,
        role: str,
        prompt_tokens: int,
        exclude: list[EngineState],
        hashes: tuple[int, ...] = (),
    ) -> EngineState | None:
        """`pick`, leaving out the engines in `exclude`; None when no engine is left."""
        try:
            return self.pick(role, prompt_tokens, exclude, hashes)
        except ProxyError:
            return None

    def pick(
        self,
        role: str,
        prompt_tokens: int,
        exclude: list[EngineState] | None = None,
        hashes: tuple[int, ...] = (),
    ) -> EngineState:
        """A healthy engine of `role` by the configured policy (`hashes`: the prompt's blocks,
        for "prefix-aware")."""
        candidates = [
            s
            for s in self.states
            if s.info.role == role and s.healthy and all(s is not e for e in exclude or ())
        ]
        if not candidates:
            raise ProxyError(503, f"no healthy {role} engine", {"Retry-After": "1"})
        fits = [s for s in candidates if self.has_room(s, prompt_tokens)]
        if not fits:
            rooms = ", ".join(
                f"{s.info.url} {s.outstanding} of {self.request_room(s) or 'any'} requests, "
                f"{s.outstanding_tokens:,} of {self.room(s) or 'any'} prompt tokens"
                for s in candidates
            )
            raise Full(
                503,
                f"no {role} engine has room for one more request of {prompt_tokens:,} "
                f"prompt tokens (in flight: {rooms}); retry later",
                {"Retry-After": "1"},
            )
        candidates = fits
        if self.config.policy == "least-outstanding":
            return min(candidates, key=lambda s: (s.outstanding, s.outstanding_tokens))
        turn = next(self._turn[role]) % len(candidates)
        if self.config.policy == "round-robin":
            return candidates[turn]
        order = candidates[turn:] + candidates[:turn]  # ties: round-robin
        if role == "decode":  # its work is the streams; a cached prefix is pushed less
            return min(order, key=lambda s: (s.outstanding, -self._match(s, hashes)))
        return min(
            order,
            key=lambda s: paths.queued_tokens(s) + paths.uncached(s, prompt_tokens, hashes),
        )

    @staticmethod
    def _match(s: EngineState, hashes: tuple[int, ...]) -> int:
        return s.prefix.match_tokens(hashes) if s.prefix is not None else 0

    def acquire(self, s: EngineState, tokens: int, waiting: bool = False) -> None:
        s.outstanding += 1
        s.outstanding_tokens += tokens
        s.waiting_on_prefill += waiting

    def release(self, s: EngineState, tokens: int, waiting: bool = False) -> None:
        s.outstanding -= 1
        s.outstanding_tokens -= tokens
        self._freed.set()  # requests waiting for room (`admit`) look again
        if waiting and s.waiting_on_prefill > 0:
            s.waiting_on_prefill -= 1

    def prefill_done(self, decode: EngineState) -> None:
        if decode.waiting_on_prefill > 0:
            decode.waiting_on_prefill -= 1

    def describe(self, s: EngineState) -> dict:
        return {
            "url": s.info.url,
            "role": s.info.role,
            "engine_id": s.info.engine_id,
            "forces_first_token": s.info.forces_first_token,
            "healthy": s.healthy,
            "error": s.error,
            "served_models": s.served_models,
            "outstanding": s.outstanding,
            "outstanding_prompt_tokens": s.outstanding_tokens,
            "waiting_on_prefill": s.waiting_on_prefill,
            "decoding": s.decoding,
            # seconds per queued prompt token to the first token (kvpush.proxy.paths)
            "s_per_token": s.rate.s_per_token,
            "kv_capacity_tokens": s.kv_capacity_tokens,
            "room_prompt_tokens": self.room(s),
            "max_num_seqs": s.max_num_seqs,
            "room_requests": self.request_room(s),
        }
