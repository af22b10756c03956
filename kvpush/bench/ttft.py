"""`kvpush bench ttft`: one streamed request at a time, as a new user tries the stack.

Prompts of the same length go through the proxy (kvpush 1P1D), through the front end in the
prefill engine's API server (the same engines, proxy/frontend.py), straight to the prefill
engine (the front end told to step aside), straight to the decode engine (which then
computes the prompt itself), and to one plain engine on both engines' cores (bench/stacks.py,
`mono`). The proxy and the plain engine get the
same prompts; the others each get prompts of their own, since the proxy's would hit the
engines' prefix caches. Medians of TTFT and TPOT for each, and of the proxy's and the front
end's timeline phases (their /timelines), above all the push tail: prefill's answer to
decode's first token, both there.
`--vllm-arg` adds an argument to every engine, so engine settings are compared run by run.
`--qps` spaces the requests (Poisson arrivals, still one at a time). Back to back (the
default) every request finds the engines' shared-memory readers still spinning from the last
one (vLLM's multiprocess executor spins 1 s after each read), which on two cores slows the
engine that is working; spaced requests measure an idle stack, as at the lowest load.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvpush import httpclient
from kvpush.bench import vllm_bench
from kvpush.bench.vllm_bench import Load
from kvpush.proxy.frontend import OFF_HEADER


def _sequential(url: str, tokenizer: str, load: Load, headers: dict | None = None) -> dict:
    """One request at a time through `vllm bench serve` (warm it up first)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ttft.json"
        return vllm_bench.run(url, tokenizer, "tiny", load, path, True, headers)


def _phase_medians(timelines: list[dict]) -> dict[str, float]:
    phases = {k for t in timelines for k in t["phases_s"]}
    return {
        k: float(np.median([t["phases_s"][k] * 1e3 for t in timelines if k in t["phases_s"]]))
        for k in sorted(phases)
    }


async def _timelines(url: str) -> list[dict]:
    async with httpclient.session() as c, c.get(url + "/timelines") as r:
        return (await r.json())["timelines"]


async def engine_phases(url: str) -> dict[str, tuple[float, float]]:
    """An engine's kvpush:phase_seconds: phase -> (sum in seconds, count), over its life."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpclient.session() as c, c.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kvpush:phase_seconds":
            continue
        for s in family.samples:
            kind = s.name.rsplit("_", 1)[-1]
            if kind in ("sum", "count"):
                out.setdefault(s.labels["phase"], [0.0, 0.0])[kind == "count"] += s.value
    return {phase: (v[0], v[1]) for phase, v in out.items()}


def _mean_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean of each phase between two engine_phases readings, in ms."""
    out = {}
    for phase, (total, count) in after.items():
        t0, c0 = before.get(phase, (0.0, 0.0))
        if count > c0:
            out[phase] = (total - t0) / (count - c0) * 1e3
    return out


def _summary(result: dict) -> dict:
    """vLLM's medians, and the median first inter-token gap from its per-request ITLs."""
    if result["failed"]:
        errors = [e for e in result.get("errors", []) if e]
        raise RuntimeError(f"{result['failed']} requests failed: {errors[:3]}")
    return {
        "median_ttft_ms": result["median_ttft_ms"],
        "median_tpot_ms": result["median_tpot_ms"],
        # the first inter-token gap: with kvpush, where the push tail goes (docs/benchmarks.md)
        "median_itl0_ms": float(np.median([i[0] for i in result["itls"] if i])) * 1e3,
    }


def main(
    out: Path | None,
    num_requests: int = 8,
    prompt_tokens: int = 300,
    output_tokens: int = 64,
    vllm_args: tuple[str, ...] = (),
    pin_cores: bool = True,
    connector_extra: dict | None = None,
    qps: float = math.inf,
    in_process: bool | None = None,
) -> int:
    from kvpush.bench.serve import hardware
    from kvpush.bench.stacks import baseline_specs
    from kvpush.launch import tinymodel
    from kvpush.launch.stack import PROXY_PORT, Stack, stack_specs
    from kvpush.settings import SETTINGS

    model = str(tinymodel.ensure())
    # one at a time; seed 0 for the proxy and the plain engine
    load = Load(qps, prompt_tokens, output_tokens, num_requests, max_concurrency=1)
    log_dir = SETTINGS.cache_dir / "logs"
    result: dict = {"benchmark": "ttft", "num_requests": num_requests, "vllm_args": vllm_args}
    result["pin_cores"], result["connector_extra"] = pin_cores, connector_extra or {}
    result["qps"] = None if math.isinf(qps) else qps  # None: back to back
    result |= {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens}

    engine_kw = {"extra_args": tuple(vllm_args), "pin_cores": pin_cores, "in_process": in_process}
    specs = stack_specs(model, "kvpush", 1, 1, connector_extra=connector_extra or {}, **engine_kw)
    # the push path's TTFT, each way in: every prompt pushed
    stack = Stack(specs, "kvpush", PROXY_PORT, log_dir, front_end=True, disaggregation="always")
    result["in_process"] = {s.name: s.executor_in_process for s in specs}  # as each ran
    print(f"kvpush bench ttft: kvpush 1P1D, engines with {list(vllm_args)}, pinned {pin_cores}")
    stack.start()
    try:
        prefill, decode = stack.specs[0].url, stack.specs[1].url
        targets = {  # name: (url, headers)
            "proxy": (stack.url, {}),
            "front_end": (prefill, {}),
            "prefill": (prefill, {OFF_HEADER.decode(): "off"}),
            "decode": (decode, {}),
        }
        for seed, (name, (url, headers)) in enumerate(targets.items()):
            vllm_bench.warm_up(url, model, "tiny", prompt_tokens, output_tokens, headers)
            before = [asyncio.run(engine_phases(u)) for u in (prefill, decode)]
            result[name] = _summary(_sequential(url, model, replace(load, seed=seed), headers))
            if name == "front_end":
                timelines = asyncio.run(_timelines(prefill + "/kvpush"))[-num_requests:]
                result["front_end_phases_median_ms"] = _phase_medians(timelines)
            if name == "proxy":
                time.sleep(1)  # the engines' stats reach /metrics with their next steps
                after = [asyncio.run(engine_phases(u)) for u in (prefill, decode)]
                result["engine_phases_mean_ms"] = {
                    role: _mean_ms(b, a)
                    for role, b, a in zip(("prefill", "decode"), before, after, strict=True)
                }
                timelines = asyncio.run(_timelines(url))[-num_requests:]
                result["proxy_phases_median_ms"] = _phase_medians(timelines)
            print(f"  {name}: {result[name]}", flush=True)
    finally:
        stack.stop()
    (mono,) = baseline_specs("mono", model, **engine_kw)  # on both engines' cores
    result["in_process"]["mono"] = mono.executor_in_process
    plain = Stack([mono], "mono", PROXY_PORT, log_dir, with_proxy=False)
    plain.start()
    try:
        vllm_bench.warm_up(plain.url, model, "tiny", prompt_tokens, output_tokens)
        result["mono"] = _summary(_sequential(plain.url, model, load))
        print(f"  mono: {result['mono']}", flush=True)
    finally:
        plain.stop()
    result |= {"hardware": hardware(), "created_unix_s": int(time.time())}
    print(f"  engine phases (means): {result['engine_phases_mean_ms']}")
    tail = result["proxy_phases_median_ms"].get("push_tail")
    print(f"push tail median (prefill's answer -> first token, at the proxy): {tail:.1f} ms")
    for name in ("proxy", "front_end"):
        ratio = result[name]["median_ttft_ms"] / result["mono"]["median_ttft_ms"]
        print(f"TTFT median, kvpush through the {name} / one plain engine: {ratio:.2f}x")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0
