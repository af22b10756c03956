"""`kvpush bench serve`: the QPS x input-length sweep, one JSON per grid point.

For each connector it brings up a local stack (or uses --url), runs every grid point with
the same QPS, input and output lists, and writes
`<mode>_qps<q>_in<in>_out<out>_iter<i>.json` into the results folder. `mono` is one plain
engine with no disaggregation: the reference for what disaggregation itself costs.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

from kvpush.bench.load import run_load

ALL_MODES = ("kvpush", "nixl-push", "nixl-pull", "mono")
# The default grid finishes in under 15 minutes on a 2-core host and still shows load build.
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
    model: str = "tiny",
    engines: dict | None = None,
) -> list[Path]:
    written = []
    # Warm-up, not recorded: the first requests of each length pay one-time compilation.
    for n_in in input_lens:
        asyncio.run(run_load(url, model, 2.0, n_in, output_lens[0], 3, seed=7))
    for it in range(iterations):
        for q in qps_list:
            for n_in in input_lens:
                for n_out in output_lens:
                    label = f"{mode} qps={q:g} in={n_in} out={n_out} iter={it}"
                    summary = asyncio.run(
                        run_load(
                            url,
                            model,
                            q,
                            n_in,
                            n_out,
                            num_prompts,
                            seed=hash((it, q, n_in, n_out)) % 2**31,  # distinct per point
                            progress=label,
                        )
                    )
                    summary["proxy_phases_ms"] = asyncio.run(proxy_phases(url, num_prompts))
                    summary |= {
                        "mode": mode,
                        "qps": q,
                        "input_len": n_in,
                        "output_len": n_out,
                        "iteration": it,
                        "num_prompts": num_prompts,
                        "url": url,
                        "engines": engines,  # how the stack's engines were started (None: --url)
                        "hardware": hardware(),
                        "created_unix_s": int(time.time()),
                    }
                    path = results_dir / result_name(mode, q, n_in, n_out, it)
                    path.write_text(json.dumps(summary, indent=1))
                    written.append(path)
                    waiting = summary["decode_waiting_on_prefill"]
                    waited = (
                        f", decode waiting on prefill max {waiting['max']:g}" if waiting else ""
                    )
                    print(
                        f"  {label}: ttft median {summary['median_ttft_ms']:.0f} ms, tpot "
                        f"median {summary['median_tpot_ms']:.1f} ms, "
                        f"{summary['failed']} failed{waited}",
                        flush=True,
                    )
    return written


async def proxy_phases(url: str, num_requests: int) -> dict | None:
    """Median and p99 (numpy's) of each timeline phase over the proxy's last `num_requests`
    requests (its /timelines), or None for an endpoint without one (a plain engine)."""
    import aiohttp
    import numpy as np

    from kvpush import httpclient

    async with httpclient.session() as c:
        try:
            async with c.get(url + "/timelines") as r:
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


def mode_stack(mode: str, model: str, log_dir: Path, **engine_kw: object) -> object:
    """1 prefill + 1 decode behind the proxy, or one plain engine for `mono`."""
    from kvpush.launch.engine import EngineSpec
    from kvpush.launch.stack import DECODE_PORT, PROXY_PORT, Stack, stack_specs

    if mode == "mono":
        spec = EngineSpec("mono", model, DECODE_PORT, connector=None, engine_id="mono", **engine_kw)
        return Stack([spec], mode, PROXY_PORT, log_dir, with_proxy=False)
    return Stack(stack_specs(model, mode, 1, 1, **engine_kw), mode, PROXY_PORT, log_dir)


def main(args: object) -> int:
    from kvpush.launch import tinymodel
    from kvpush.settings import SETTINGS

    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    modes = [m.strip() for m in args.connectors.split(",")]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        print(f"unknown connectors {bad}; choose from {ALL_MODES}")
        return 2
    grid = dict(
        qps_list=[float(q) for q in args.qps.split(",")],
        input_lens=[int(x) for x in args.input_lens.split(",")],
        output_lens=[int(x) for x in args.output_lens.split(",")],
        iterations=args.iterations,
        num_prompts=args.num_prompts,
    )
    if args.url:
        sweep(modes[0], args.url, results_dir=results_dir, **grid)
        return 0
    model = args.model or str(tinymodel.ensure())
    engine_kw = {"extra_args": tuple(args.vllm_arg), "pin_cores": args.pin_cores}
    for mode in modes:
        print(f"kvpush bench serve: bringing up {mode} {engine_kw}", flush=True)
        stack = mode_stack(mode, model, SETTINGS.cache_dir / "logs", **engine_kw)
        stack.start()
        try:
            engines = engine_kw | {"extra_args": list(args.vllm_arg)}
            sweep(mode, stack.url, results_dir=results_dir, engines=engines, **grid)
        finally:
            stack.stop()
    print(f"results in {results_dir}; plot them with `kvpush plot {results_dir}`")
    return 0
