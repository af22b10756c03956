"""`kvpush bench serve`: the QPS x input-length sweep, one `vllm bench serve` per grid point.

For each stack (bench/stacks.py: kvpush, vLLM's connectors, and the plain-engine baselines on
the same cores) it brings up a local stack (or uses --url), runs every grid point with the
same QPS, input and output lists (with `--rounds N`, the stacks in turn, N times over), and
writes vLLM's result JSON as `<mode>_qps<q>_in<in>_out<out>_iter<i>.json` into a results
folder of its own, with kvpush's additions: the grid point, hardware, how each engine ran
(cores, executor, prefix caching), the prompts' seed, the engines' prefix-cache hits during
the point (0 expected: the prompts are fresh, bench/prompts.py), the SLO targets and the share
of requests that met both (bench/slo.py), the proxy's per-phase timeline and
`decode_waiting_on_prefill`.

The grid is a loop here, not `vllm bench sweep serve`: that tool starts one server command
per combination and names its results its own way, while a kvpush stack is several
processes, and each point also needs the proxy's /metrics and /timelines read around it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from kvpush.bench import defaults, plan, vllm_bench
from kvpush.bench.prompts import PromptSource, SharedPrefix, new_seed
from kvpush.bench.slo import SloConfig, attainment
from kvpush.bench.stacks import ALL_MODES, FRONT_END, connector_of, describe, mode_stack, mode_url

DEFAULT_SLO = SloConfig(defaults.SLO_TTFT_MS, defaults.SLO_TPOT_MS)


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


def point_key(iteration: int, qps: float, input_len: int, output_len: int) -> tuple:
    """The prompt set of one grid point's iteration: the same for every stack of a run."""
    return ("point", iteration, qps, input_len, output_len)


def warm_up_key(first_iteration: int, input_len: int) -> tuple:
    """The warm-up's prompts before a stack's points of this length in one round."""
    return ("warm-up", first_iteration, input_len)


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
    prompts: PromptSource,
    slo: SloConfig = DEFAULT_SLO,
    model_name: str = "tiny",
    engines: dict | None = None,
    first_iteration: int = 0,
    metrics_urls: tuple[str, ...] = (),
) -> list[Path]:
    """A warm-up per input length, then every grid point, each one `vllm bench serve` with
    fresh prompts from `prompts`; one line per point as it finishes. Iterations are numbered
    from `first_iteration` (a later round of `--rounds`), which also picks their prompts.
    `metrics_urls`: the engines whose prefix-cache hits during each point are recorded."""
    written = []
    prefix = "/kvpush" if mode == FRONT_END else ""
    timelines, status_url = f"{url}{prefix}/timelines", f"{url}{prefix}/status"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for n_in in input_lens:
            key = warm_up_key(first_iteration, n_in)
            warm = prompts.write(folder, key, vllm_bench.NUM_WARM_UP, n_in)
            vllm_bench.warm_up(url, tokenizer, model_name, n_in, output_lens[0], prompts=warm)
        for it in range(first_iteration, first_iteration + iterations):
            for q in qps_list:
                for n_in in input_lens:
                    for n_out in output_lens:
                        label = f"{mode} qps={q:g} in={n_in} out={n_out} iter={it}"
                        print(f"  {label}: vllm bench serve ...", flush=True)
                        key = point_key(it, q, n_in, n_out)
                        load = vllm_bench.Load(
                            q, n_in, n_out, num_prompts, slo_ms=slo.goodput,
                            prompts=prompts.write(folder, key, num_prompts, n_in),
                        )  # fmt: skip
                        path = results_dir / result_name(mode, q, n_in, n_out, it)
                        before = asyncio.run(prefix_cache(metrics_urls))
                        result = vllm_bench.run(url, tokenizer, model_name, load, path, True)
                        after = asyncio.run(prefix_cache(metrics_urls))
                        got = asyncio.run(proxy_json(timelines)) or {}
                        recent = got.get("timelines", [])[-num_prompts:] if got else None
                        status = asyncio.run(proxy_json(status_url))
                        result |= {
                            "mode": mode,
                            "qps": q,
                            "input_len": n_in,
                            "output_len": n_out,
                            "iteration": it,
                            "url": url,
                            "engines": engines,  # how each engine ran (None: --url)
                            "hardware": hardware(),
                            "created_unix_s": int(time.time()),
                            "prompts": {
                                "seed": prompts.seed,
                                "set": list(key),
                                "shared_prefix": dataclasses.asdict(prompts.shared)
                                if prompts.shared
                                else None,
                            },
                            "prefix_cache": changes(before, after),
                            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
                            "proxy_phases_ms": proxy_phases(recent),
                            "proxy_paths": path_counts(recent),
                            "plan": point_plan(status, recent, slo),
                            # vLLM counts a stream that ends in an error event as completed;
                            # with EOS ignored, a short answer is how such a stream shows
                            "short_outputs": sum(n < n_out for n in result.get("output_lens", [])),
                        }
                        result["slo_attainment"] = attainment(result, slo)
                        path.write_text(json.dumps(result, indent=1))
                        written.append(path)
                        print(f"  {label}: {point_line(result)}", flush=True)
                        if prompts.shared is None:  # else hits are the point
                            warn_on_hits(label, result["prefix_cache"])
    return written


async def prefix_cache(urls: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """Each engine's vLLM prefix-cache counters, url -> (hits, queries) in tokens; an
    endpoint without them (a proxy) is left out."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    from kvpush import httpclient

    out = {}
    async with httpclient.session() as c:
        for url in urls:
            try:
                async with c.get(url + "/metrics") as r:
                    text = await r.text() if r.status == 200 else ""
            except aiohttp.ClientError:
                continue
            sums = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
            seen = False
            for family in text_string_to_metric_families(text):
                if family.name in sums:
                    seen = True
                    sums[family.name] += sum(
                        s.value for s in family.samples if s.name.endswith("_total")
                    )
            if seen:
                out[url] = (sums["vllm:prefix_cache_hits"], sums["vllm:prefix_cache_queries"])
    return out


def changes(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Prefix-cache tokens hit and queried per engine between two `prefix_cache` readings."""
    return {
        url: {
            "hits": hits - before.get(url, (0, 0))[0],
            "queries": queries - before.get(url, (0, 0))[1],
        }  # fmt: skip
        for url, (hits, queries) in after.items()
    }


def warn_on_hits(label: str, cache: dict[str, dict[str, float]]) -> None:
    hit = {url: int(c["hits"]) for url, c in cache.items() if c["hits"]}
    if hit:
        print(
            f"  WARNING {label}: prefix-cache hits {hit} (tokens) on prompts that should be new "
            "to every engine: were these prompts sent before (the same --seed against a live "
            "deployment)?",
            flush=True,
        )


def point_line(r: dict) -> str:
    waiting = r.get("decode_waiting_on_prefill")
    waited = f", decode waiting on prefill max {waiting['max']:g}" if waiting else ""
    share = r.get("slo_attainment")
    slo_text = f", {share:.0%} within the SLO" if share is not None else ""
    cache = (r.get("prefix_cache") or {}).values()
    hits, queries = sum(c["hits"] for c in cache), sum(c["queries"] for c in cache)
    hit_text = f", prefix-cache hits {hits / queries:.0%}" if hits else ""
    return (
        f"ttft median {r['median_ttft_ms']:.0f} ms, tpot median {r['median_tpot_ms']:.1f} ms, "
        f"itl median {r['median_itl_ms']:.1f} ms, {r['failed']} failed, "
        f"{r.get('short_outputs', 0)} short{waited}{slo_text}{hit_text}"
    )


async def proxy_json(url: str) -> dict | None:
    """The JSON a proxy or front end answers at `url` (its /timelines, /status), or None for
    an endpoint without it (a plain engine)."""
    import aiohttp

    from kvpush import httpclient

    async with httpclient.session() as c:
        try:
            async with c.get(url) as r:
                if r.status != 200:
                    return None
                return await r.json()
        except (aiohttp.ClientError, ValueError):
            return None


def point_plan(status: dict | None, recent: list[dict] | None, slo: SloConfig) -> dict | None:
    """What `kvpush plan` would have said of this point's requests (kvpush.bench.plan)."""
    if status is None or recent is None or "engines" not in status:
        return None
    return dataclasses.asdict(plan.plan(status, recent, slo))


def path_counts(timelines: list[dict] | None) -> dict[str, int] | None:
    """How many requests took each path (kvpush.proxy.paths), where the timelines say."""
    if timelines is None:
        return None
    counts: dict[str, int] = {}
    for t in timelines:
        if t.get("path"):
            counts[t["path"]] = counts.get(t["path"], 0) + 1
    return counts


def proxy_phases(timelines: list[dict] | None) -> dict | None:
    """Median and p99 (numpy's) of each timeline phase over `timelines`."""
    import numpy as np

    if timelines is None:
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


def main(args: argparse.Namespace) -> int:
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
        slo = SloConfig(args.slo_ttft_ms, args.slo_tpot_ms)
        shared = None
        if args.shared_prefix or args.num_prefixes:
            shared = SharedPrefix(args.shared_prefix, args.num_prefixes or 1)
            if shared.prefix_len >= min(grid["input_lens"]):
                raise ValueError("--shared-prefix must be shorter than every --input-lens")
    except ValueError as e:
        print(f"kvpush bench serve: {e}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.connectors.split(",")]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad and not args.url:
        print(f"kvpush bench serve: unknown connectors {bad}; choose from {ALL_MODES}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.url and not args.mode:
        print("kvpush bench serve: --url needs --mode NAME (the results' name for it)",
              file=sys.stderr)  # fmt: skip
        return 2
    results_dir = Path(args.results_dir)
    if any(results_dir.glob("*_qps*_in*_out*_iter*.json")) and not args.append:
        print(f"kvpush bench serve: {results_dir} already holds results; name a new folder, "
              "or pass --append to add to them", file=sys.stderr)  # fmt: skip
        return 2
    results_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or str(tinymodel.ensure())
    tokenizer = args.tokenizer or model
    seed = args.seed if args.seed is not None else new_seed()
    print(f"kvpush bench serve: prompts from seed {seed} (--seed {seed} sends the same again)",
          flush=True)  # fmt: skip
    prompts = PromptSource(tokenizer, seed, shared)
    if args.url:
        grid["iterations"] *= args.rounds  # one endpoint: no stacks to take in turn
        url = args.url.rstrip("/")
        metrics = tuple(u.rstrip("/") for u in args.metrics_url) or (url,)
        sweep(args.mode, url, results_dir=results_dir, tokenizer=tokenizer, prompts=prompts,
              slo=slo, model_name=args.served_model_name, metrics_urls=metrics, **grid)  # fmt: skip
        print(f"results in {results_dir}; plot them with `kvpush plot {results_dir}`")
        return 0
    engine_kw = {
        "extra_args": tuple(args.vllm_arg),
        "pin_cores": args.pin_cores,
        "in_process": args.in_process_executor,
    }
    connector_extra = args.connector_extra  # checked by the argument parser
    for n, (mode, first) in enumerate(rounds(modes, args.rounds, args.iterations), 1):
        turn = f" (stack {n} of {len(modes) * args.rounds})" if args.rounds > 1 else ""
        print(f"kvpush bench serve: bringing up {mode}{turn}", flush=True)
        stack = mode_stack(mode, model, SETTINGS.cache_dir / "logs", connector_extra, **engine_kw)
        stack.start()
        try:
            engines = describe(stack)
            for name, engine in engines.items():
                if connector_of(mode) == "kvpush":
                    engine["connector_extra"] = connector_extra
                engine["extra_args"] = list(args.vllm_arg)
                print(f"  {name}: {engine}", flush=True)
            sweep(mode, mode_url(mode, stack), results_dir=results_dir, tokenizer=tokenizer,
                  prompts=prompts, slo=slo, engines=engines, first_iteration=first,
                  metrics_urls=tuple(s.url for s in stack.specs), **grid)  # fmt: skip
        finally:
            stack.stop()
    print(f"results in {results_dir}; plot them with `kvpush plot {results_dir}`")
    return 0
