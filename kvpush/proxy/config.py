"""The proxy's configuration: its engines (from a YAML/TOML file, `kvpush serve` description
files, or flags) and its settings, checked once."""

from __future__ import annotations

import asyncio
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpush.proxy.paths import DISAGGREGATION, PrefillRate
from kvpush.proxy.prefix import PrefixIndex

MODES = ("push", "pull")
CONNECTORS = {"kvpush": "push", "nixl-push": "push", "nixl-pull": "pull"}
POLICIES = ("prefix-aware", "round-robin", "least-outstanding")


@dataclass(frozen=True)
class EngineInfo:
    url: str
    role: str  # "prefill" or "decode"
    engine_id: str = ""
    kv_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    tp_size: int = 1
    pp_size: int = 1
    connector: str = ""  # what the engine runs, if its description says; must match the proxy's
    served_model_name: str = ""  # informational; the proxy reads /v1/models
    # decode: the engine forces the first token to prefill's (kvpush's FirstTokenProcessor,
    # which `kvpush serve` loads and declares), so the client may get prefill's token first
    forces_first_token: bool = False
    # whether the engine keeps a prefix cache (prefix-aware routing); None: vLLM's default, on
    prefix_caching: bool | None = None

    @property
    def caches_prefixes(self) -> bool:
        return self.prefix_caching if self.prefix_caching is not None else True

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(
                f"engine {self.url}: role must be prefill or decode, got {self.role!r}"
            )
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {self.url!r}")
        if not isinstance(self.forces_first_token, bool):
            raise ValueError(
                f"engine {self.url}: forces_first_token must be true or false, "
                f"got {self.forces_first_token!r}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineInfo:
        check_keys(d, cls.__dataclass_fields__, f"engine {d.get('url', '?')}")
        return cls(**d)


@dataclass(frozen=True)
class ProxyConfig:
    engines: tuple[EngineInfo, ...]
    connector: str = "kvpush"
    # among engines of one role: the fewest prompt tokens to compute, its own less the
    # engine's likely prefix-cache hit (kvpush.proxy.prefix), round-robin on a tie
    policy: str = "prefix-aware"
    # prompt tokens a decode engine may hold for requests in flight: beyond, a request waits
    # up to admission_wait_s for room, then gets 503 Retry-After. None: 90 % of the engine's
    # KV cache, as its /metrics says (vllm:cache_config_info), else no bound
    max_decode_prompt_tokens: int | None = None
    # requests in flight on one decode engine: beyond, a request waits as above. None: the
    # engine's max_num_seqs (kvpush engines say it at /kvpush/limits), else no bound. More
    # would wait in vLLM's queue, their pushes' KV held on prefill until decode takes them
    max_decode_requests: int | None = None
    # requests in flight on one prefill engine (its prefill legs, and requests it serves
    # whole). None: its max_num_seqs, as above. With every prefill engine at its bound, a
    # pushed request's prompt is computed on its decode engine instead
    max_prefill_requests: int | None = None
    admission_wait_s: float = 5.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    api_key: str | None = None  # forwarded to engines when the client sends none
    # kvpush, streamed: the client's first token is prefill's, sent as soon as prefill answers,
    # where the decode engine declares `forces_first_token`; False: always decode's
    first_token: bool = True
    # kvpush: every prompt pushed, or every engine a plain replica, whichever recent requests
    # say ends requests sooner ("auto"; kvpush.proxy.paths); "always" pushes every prompt,
    # "never" none
    disaggregation: str = "auto"
    # a stream whose engine fails mid-answer continues on another engine, at most this many
    # times (kvpush.proxy.migrate); 0: it ends with an error event
    max_migrations: int = 2

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(
                f"connector must be one of {sorted(CONNECTORS)}, got {self.connector!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for role in ("prefill", "decode"):
            if not any(e.role == role for e in self.engines):
                raise ValueError(f"the proxy needs at least one {role} engine")
        if self.disaggregation not in DISAGGREGATION:
            raise ValueError(
                f"disaggregation must be one of {DISAGGREGATION}, got {self.disaggregation!r}"
            )
        if self.max_decode_prompt_tokens is not None and self.max_decode_prompt_tokens < 1:
            raise ValueError("max_decode_prompt_tokens must be >= 1")
        for name in ("max_decode_requests", "max_prefill_requests"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.admission_wait_s < 0:
            raise ValueError(f"admission_wait_s must be >= 0, got {self.admission_wait_s}")
        for e in self.engines:
            if e.connector and e.connector != self.connector:
                raise ValueError(
                    f"engine {e.url} runs connector {e.connector!r}, the proxy "
                    f"{self.connector!r}: start the proxy with --connector {e.connector}"
                )

    @property
    def mode(self) -> str:
        return CONNECTORS[self.connector]

    @property
    def early_first_token(self) -> bool:
        """kvpush with `first_token` on: prefill's token first, to decode engines that
        declare `forces_first_token` (streamed requests only)."""
        return self.connector == "kvpush" and self.first_token

    def of_role(self, role: str) -> list[EngineInfo]:
        return [e for e in self.engines if e.role == role]


def check_keys(d: dict[str, Any], known: Any, where: str) -> None:
    """Refuse keys a dataclass does not have, naming them and the accepted ones."""
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; accepted: {sorted(known)}")


def load_engines(paths: list[str]) -> list[EngineInfo]:
    """Engine description JSON files written by `kvpush serve`, or a YAML/TOML file with an
    `engines:` list (and optional settings, returned via load_file)."""
    engines: list[EngineInfo] = []
    for p in paths:
        engines += [EngineInfo.from_dict(d) for d in _read(Path(p)).get("engines", [])] or [
            EngineInfo.from_dict(_read(Path(p)))
        ]
    return engines


def load_file(path: str) -> dict[str, Any]:
    data = _read(Path(path))
    check_keys(data, ProxyConfig.__dataclass_fields__, path)
    data["engines"] = [EngineInfo.from_dict(d) for d in data.get("engines", [])]
    return data


def _read(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        return yaml.safe_load(text) or {}
    return json.loads(text)


@dataclass
class EngineState:
    info: EngineInfo
    healthy: bool = True
    missed_checks: int = 0
    served_models: list[str] = field(default_factory=list)
    error: str = ""
    outstanding: int = 0
    outstanding_tokens: int = 0
    waiting_on_prefill: int = 0  # decode: requests holding blocks until prefill is done
    connections_opened: int = 0  # TCP connections the pool opened to it
    # prompt tokens it is computing for requests it serves whole (paths `local`, `whole`)
    local_tokens: int = 0
    decoding: int = 0  # requests past their first token, streaming from this engine
    # seconds per queued prompt token to the first token, measured (kvpush.proxy.paths)
    rate: PrefillRate = field(default_factory=PrefillRate)
    # the prompt blocks it likely holds (kvpush.proxy.prefix); None: it keeps no prefix cache
    prefix: PrefixIndex | None = None
    kv_capacity_tokens: int | None = None  # its KV cache, from its /metrics, once read
    max_num_seqs: int | None = None  # from its /kvpush/limits, once read; 0: it does not say
    # set when the engine is taken out of rotation (EnginePool.mark_down); a new one when it
    # comes back: a stream waiting on this engine's push watches it (proxy/relay.py)
    down: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.prefix is None and self.info.caches_prefixes:
            self.prefix = PrefixIndex()
