"""The stacks `kvpush bench serve` compares, each on the same hardware.

- `kvpush`: 1 prefill + 1 decode behind kvpush's proxy; `kvpush-front-end`: the same engines,
  clients at the prefill engine's own front end (proxy/frontend.py);
- `nixl-push`, `nixl-pull`: 1P1D with vLLM's own NIXL connectors, behind kvpush's proxy;
- `mono`: one plain engine on all the cores the 1P1D stack uses (and their KV cache), on
  vLLM's in-process executor; `mono-mp`: the same on vLLM's multiprocess executor, so that
  both of a plain engine's executors are measured and the better one is known;
- `replicas`: one plain engine per 1P1D engine, each on that engine's cores, requests dealt
  round-robin (bench/roundrobin.py): the data-parallel baseline DistServe compares against.

Plain engines keep vLLM's defaults otherwise (prefix caching on).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvpush.launch.engine import EngineSpec
from kvpush.launch.stack import DECODE_PORT, PROXY_PORT, Stack, stack_specs

FRONT_END = "kvpush-front-end"  # kvpush, clients at the prefill engine's front end
BASELINES = ("mono", "mono-mp", "replicas")
ALL_MODES = ("kvpush", FRONT_END, "nixl-push", "nixl-pull", *BASELINES)
NUM_PREFILL, NUM_DECODE = 1, 1


def connector_of(mode: str) -> str | None:
    """The connector a mode's engines run (FRONT_END: kvpush's; baselines: none)."""
    if mode in BASELINES:
        return None
    return "kvpush" if mode == FRONT_END else mode


def disaggregated_specs(model: str, connector: str, **engine_kw: Any) -> list[EngineSpec]:
    return stack_specs(model, connector, NUM_PREFILL, NUM_DECODE, **engine_kw)


def baseline_specs(mode: str, model: str, **engine_kw: Any) -> list[EngineSpec]:
    """The plain engines of a baseline, on the hardware of the 1P1D stack; the executor is
    the mode's (`mono-mp`: multiprocess, else in-process), whatever `engine_kw` says."""
    engine_kw = {k: v for k, v in engine_kw.items() if k not in ("connector_extra", "in_process")}
    engine_kw["in_process"] = mode != "mono-mp"
    shares = disaggregated_specs(model, "kvpush", **engine_kw)
    if mode == "replicas":
        return [
            EngineSpec(
                "mono",
                model,
                DECODE_PORT + i,
                connector=None,
                engine_id=f"replica-{i}",
                cpu_bind=s.cpu_cores,
                kv_cache_gib=s.kv_cache_gib,
                **engine_kw,
            )
            for i, s in enumerate(shares)
        ]
    cores = sorted({c for s in shares for c in _cpu_ids(s.cpu_cores)})
    spec = EngineSpec(
        "mono",
        model,
        DECODE_PORT,
        connector=None,
        engine_id=mode,
        cpu_bind=",".join(map(str, cores)),
        kv_cache_gib=sum(s.kv_cache_gib for s in shares),
        **engine_kw,
    )
    return [spec]


def _cpu_ids(cores: str) -> list[int]:
    """ "0,2-3" -> [0, 2, 3]."""
    out: list[int] = []
    for part in cores.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def mode_stack(
    mode: str,
    model: str,
    log_dir: Path,
    connector_extra: dict | None = None,
    disaggregation: str | None = None,
    **engine_kw: Any,
) -> Stack:
    """The stack a mode names; `connector_extra` goes into kvpush's kv_connector_extra_config,
    `disaggregation` into kvpush's proxy and front ends (None: their default, auto)."""
    if mode in BASELINES:
        specs = baseline_specs(mode, model, **engine_kw)
        if mode != "replicas":
            return Stack(specs, mode, PROXY_PORT, log_dir, with_proxy=False)
        front = [sys.executable, "-m", "kvpush.bench.roundrobin", "--port", str(PROXY_PORT)]
        return Stack(specs, mode, PROXY_PORT, log_dir, proxy_cmd=front + [s.url for s in specs])
    connector = connector_of(mode)
    assert connector is not None  # a disaggregated mode
    if connector == "kvpush" and connector_extra:
        engine_kw = engine_kw | {"connector_extra": connector_extra}
    specs = disaggregated_specs(model, connector, **engine_kw)
    return Stack(
        specs, connector, PROXY_PORT, log_dir, front_end=mode == FRONT_END,
        disaggregation=disaggregation if connector == "kvpush" else None,
    )  # fmt: skip


def mode_url(mode: str, stack: Stack) -> str:
    """Where a mode's clients go: the prefill engine for FRONT_END, else the stack's URL."""
    return stack.specs[0].url if mode == FRONT_END else stack.url


def describe(stack: Stack) -> dict[str, dict]:
    """How each engine of a stack ran: role, cores, executor, prefix caching, KV cache."""
    out = {}
    for s in stack.specs:
        prefix = s.prefix_enabled
        out[s.name] = {
            "url": s.url,
            "role": "plain" if s.role == "mono" else s.role,
            "connector": s.connector,
            "cores": s.cpu_cores if s.on_cpu else None,
            "executor": "in-process" if s.executor_in_process else "multiprocess",
            "prefix_caching": prefix,
            "kv_cache_gib": s.kv_cache_gib,
        }
    return out
