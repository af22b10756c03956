"""`kvpush bench serve`: the QPS x input-length sweep, one `vllm bench serve` per grid point.

For each connector it brings up a local stack (or uses --url), runs every grid point with
the same QPS, input and output lists (with `--rounds N`, the stacks in turn, N times over),
and writes vLLM's result JSON as `<mode>_qps<q>_in<in>_out<out>_iter<i>.json` into the
results folder, with kvpush's additions
(mode, grid point, hardware, the engines' settings, the proxy's per-phase timeline and
`decode_waiting_on_prefill`). `mono` is one plain engine with no disaggregation: the reference
for what disaggregation itself costs. `kvpush-front-end` is the kvpush stack with the clients'
requests sent to the prefill engine's own front end (proxy/frontend.py) instead of the proxy.

The grid is a loop here, not `vllm bench sweep serve`: that tool starts one server command
per combination and names its results its own way, while a kvpush stack is several
processes, and each point also needs the proxy's /metrics and /timelines read around it.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from kvpush.bench import vllm_bench

FRONT_END = "kvpush-front-end"  # kvpush, clients at the prefill engine's front end
ALL_MODES = ("kvpush", FRONT_END, "nixl-push", "nixl-pull", "mono")
# The default grid takes about 4 minutes per connector on a 2-core host and still shows load
# build.
DEFAULT_QPS = (1.0, 4.0)
DEFAULT_INPUT_LENS = (256, 1024)
DEFAULT_OUTPUT_LENS = (16,)
DEFAULT_NUM_PROMPTS = 16


def result_name(mode: str, qps: float, input_len: int, output_len: int, iteration: int) -> str:
    q = f"{qps:g}"
    return f"{mode}_qps{q}_in{input_len}_out{output_len}_iter{iteration}.json"


def hardware() -> dict:
    return {
        "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def sweep(
    mode: str,
    url: str,
    qps_list: list[float],
    input_lens: list[int],
    output_lens: list[int],
    iterations: int,
    num_prompts: int,
    results_dir: Path,
    tokenizer: str,
    model_name: str = "tiny",
    engines: dict | None = None,
    first_iteration: int = 0,
) -> list[Path]:
    """A warm-up per input length, then every grid point, each one `vllm bench serve`; one
    line per point as it finishes. Iterations are numbered from `first_iteration` (a later
    round of `--rounds`), which also picks their prompts."""
    written = []
    timelines = url + ("/kvpush/timelines" if mode == FRONT_END else "/timelines")
    for n_in in input_lens:
        vllm_bench.warm_up(url, tokenizer, model_name, n_in, output_lens[0])
    for it in range(first_iteration, first_iteration + iterations):
        for q in qps_list:
            for n_in in input_lens:
                for n_out in output_lens:
                    label = f"{mode} qps={q:g} in={n_in} out={n_out} iter={it}"
                    print(f"  {label}: vllm bench serve ...", flush=True)
                    seed = hash((it, q, n_in, n_out)) % 2**31  # distinct prompts per point
                    load = vllm_bench.Load(q, n_in, n_out, num_prompts, seed=seed)
                    path = results_dir / result_name(mode, q, n_in, n_out, it)
                    result = vllm_bench.run(url, tokenizer, model_name, load, path, quiet=True)
                    result |= {
                        "mode": mode,
                        "qps": q,
                        "input_len": n_in,
                        "output_len": n_out,
                        "iteration": it,
                        "url": url,
                        "engines": engines,  # how the stack's engines were started (None: --url)
                        "hardware": hardware(),
                        "created_unix_s": int(time.time()),
                        "proxy_phases_ms": asyncio.run(proxy_phases(timelines, num_prompts)),
                        # vLLM counts a stream that ends in an error event as completed; with
                        # EOS ignored, a short answer is how such a stream shows
                        "short_outputs": sum(n < n_out for n in result.get("output_lens", [])),
                    }
                    path.write_text(json.dumps(result, indent=1))
                    written.append(path)
                    print(f"  {label}: {point_line(result)}", flush=True)
    return written


def point_line(r: dict) -> str:
    waiting = r.get("decode_waiting_on_prefill")
    waited = f", decode waiting on prefill max {waiting['max']:g}" if waiting else ""
    return (
        f"ttft median {r['median_ttft_ms']:.0f} ms, tpot median {r['median_tpot_ms']:.1f} ms, "
        f"itl median {r['median_itl_ms']:.1f} ms, {r['failed']} failed, "
        f"{r.get('short_outputs', 0)} short{waited}"
    )


async def proxy_phases(url: str, num_requests: int) -> dict | None:
    """Median and p99 (numpy's) of each timeline phase over the last `num_requests` requests
    of the proxy's or front end's timelines at `url`, or None for an endpoint without them
    (a plain engine)."""
    import aiohttp
    import numpy as np

    from kvpush import httpclient

    async with httpclient.session() as c:
        try:
            async with c.get(url) as r:
                if r.status != 200:
                    return None
                timelines = (await r.json())["timelines"][-num_requests:]
        except (aiohttp.ClientError, ValueError, KeyError):
            return None
    names = sorted({k for t in timelines for k in t["phases_s"]})
    out = {}
    for name in names:
        values = [t["phases_s"][name] * 1e3 for t in timelines if name in t["phases_s"]]
        out[name] = {
            "median": float(np.median(values)),
            "p99": float(np.percentile(values, 99)),
            "count": len(values),
        }
    return out


def mode_stack(
    mode: str, model: str, log_dir: Path, connector_extra: dict | None = None, **engine_kw: object
) -> object:
    """1 prefill + 1 decode behind the proxy (for FRONT_END the prefill engine is also a
    front end), or one plain engine for `mono`; `connector_extra` goes into kvpush's
    kv_connector_extra_config."""
    from kvpush.launch.engine import EngineSpec
    from kvpush.launch.stack import DECODE_PORT, PROXY_PORT, Stack, stack_specs

    if mode == "mono":
        spec = EngineSpec("mono", model, DECODE_PORT, connector=None, engine_id="mono", **engine_kw)
        return Stack([spec], mode, PROXY_PORT, log_dir, with_proxy=False)
    connector = connector_of(mode)
    if connector == "kvpush" and connector_extra:
        engine_kw = engine_kw | {"connector_extra": connector_extra}
    specs = stack_specs(model, connector, 1, 1, **engine_kw)
    return Stack(specs, connector, PROXY_PORT, log_dir, front_end=mode == FRONT_END)


def connector_of(mode: str) -> str:
    """The connector a mode's stack runs (FRONT_END: kvpush's)."""
    return "kvpush" if mode == FRONT_END else mode


def mode_url(mode: str, stack: Any) -> str:
    """Where a mode's clients go: the prefill engine for FRONT_END, else the stack's URL."""
    return stack.specs[0].url if mode == FRONT_END else stack.url


def _numbers(text: str, kind: type, flag: str) -> list:
    """A comma-separated list of positive numbers; ValueError naming the flag."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} must be numbers > 0, got {text!r}")
    return values


def rounds(modes: list[str], num_rounds: int, iterations: int) -> list[tuple[str, int]]:
    """Each stack to bring up, in order, with the first iteration number of its results: the
    modes in turn, `num_rounds` times. A host whose speed drifts over minutes (a shared one)
    then drifts under every connector alike, instead of under whichever ran last."""
    return [(m, r * iterations) for r in range(num_rounds) for m in modes]


def main(args: object) -> int:
    from kvpush.launch import tinymodel
    from kvpush.settings import SETTINGS

    try:
        grid = dict(
            qps_list=_numbers(args.qps, float, "--qps"),
            input_lens=_numbers(args.input_lens, int, "--input-lens"),
            output_lens=_numbers(args.output_lens, int, "--output-lens"),
            iterations=args.iterations,
            num_prompts=args.num_prompts,
        )
        if args.num_prompts < 1 or args.iterations < 1 or args.rounds < 1:
            raise ValueError("--num-prompts, --iterations and --rounds must be >= 1")
    except ValueError as e:
        print(f"kvpush bench serve: {e}", file=sys.stderr)
        return 2
    results_dir = Path(args.results_dir)
    if args.url:
        if not args.mode:
            print("kvpush bench serve: --url needs --mode NAME (the results' name for it)",
                  file=sys.stderr)  # fmt: skip
            return 2
        results_dir.mkdir(parents=True, exist_ok=True)
        tokenizer = args.tokenizer or args.model or str(tinymodel.ensure())
        grid["iterations"] *= args.rounds  # one endpoint: no stacks to take in turn
        sweep(args.mode, args.url.rstrip("/"), results_dir=results_dir, tokenizer=tokenizer,
              model_name=args.served_model_name, **grid)  # fmt: skip
        print(f"results in {results_dir}; plot them with `kvpush plot {results_dir}`")
        return 0
    modes = [m.strip() for m in args.connectors.split(",")]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        print(f"kvpush bench serve: unknown connectors {bad}; choose from {ALL_MODES}",
              file=sys.stderr)  # fmt: skip
        return 2
    results_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or str(tinymodel.ensure())
    engine_kw = {
        "extra_args": tuple(args.vllm_arg),
        "pin_cores": args.pin_cores,
        "in_process": args.in_process_executor,
    }
    connector_extra = args.connector_extra  # checked by the argument parser
    for n, (mode, first) in enumerate(rounds(modes, args.rounds, args.iterations), 1):
        turn = f" (stack {n} of {len(modes) * args.rounds})" if args.rounds > 1 else ""
        print(f"kvpush bench serve: bringing up {mode}{turn} {engine_kw}", flush=True)
        stack = mode_stack(mode, model, SETTINGS.cache_dir / "logs", connector_extra, **engine_kw)
        stack.start()
        try:
            in_process = {s.name: s.executor_in_process for s in stack.specs}  # as each ran
            engines = engine_kw | {"extra_args": list(args.vllm_arg), "in_process": in_process}
            if connector_of(mode) == "kvpush":
                engines["connector_extra"] = connector_extra
            tokenizer = args.tokenizer or model
            url = mode_url(mode, stack)
            sweep(mode, url, results_dir=results_dir, tokenizer=tokenizer, engines=engines,
                  first_iteration=first, **grid)  # fmt: skip
        finally:
            stack.stop()
    print(f"results in {results_dir}; plot them with `kvpush plot {results_dir}`")
    return 0
