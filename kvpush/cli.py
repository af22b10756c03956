"""`kvpush <command>`: every entry point, with heavy imports deferred to the command run."""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _model(args: argparse.Namespace) -> int:
    from kvpush.launch import tinymodel

    out = tinymodel.build(Path(args.out)) if args.out else tinymodel.ensure()
    print(f"{tinymodel.NAME} written to {out} (sha256 {tinymodel.digest(out)[:16]})")
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvpush.bench import transfer

    out = Path(args.out) if args.out else None
    return transfer.main(quick=args.quick, out=out, device=args.device)


def _proxy(args: argparse.Namespace) -> int:
    from kvpush.proxy import cli

    return cli.main(args)


def _bench_proxy(args: argparse.Namespace) -> int:
    from kvpush.bench import proxy

    return proxy.main(
        out=Path(args.out) if args.out else None,
        profile=Path(args.profile) if args.profile else None,
    )


def _bench_ttft(args: argparse.Namespace) -> int:
    from kvpush.bench import ttft

    out = Path(args.out) if args.out else None
    return ttft.main(
        out,
        args.num_requests,
        args.prompt_tokens,
        args.output_tokens,
        tuple(args.vllm_arg),
        args.pin_cores,
        args.connector_extra,
        args.qps,
        args.in_process_executor,
    )


def _bench_serve(args: argparse.Namespace) -> int:
    from kvpush.bench import serve

    return serve.main(args)


def _bench_chaos(args: argparse.Namespace) -> int:
    from kvpush.bench import chaos

    return chaos.main(args)


def _plan(args: argparse.Namespace) -> int:
    import urllib.error

    from kvpush.bench import plan
    from kvpush.bench.slo import SloConfig

    try:
        slo = SloConfig(args.slo_ttft_ms, args.slo_tpot_ms)
        if args.last is not None and args.last < 2:
            raise ValueError(f"--last must be at least 2, got {args.last}")
    except ValueError as e:
        print(f"kvpush plan: {e}", file=sys.stderr)
        return 2
    try:
        status, timelines = plan.fetch(args.url)
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"kvpush plan: cannot read the proxy at {args.url}: {e}", file=sys.stderr)
        return 1
    result = plan.plan(status, timelines, slo, args.last)
    print(plan.as_json(result) if args.json else result.text())
    return 0


def _plot(args: argparse.Namespace) -> int:
    from kvpush.bench import plot
    from kvpush.bench.slo import SloConfig

    given = (args.slo_ttft_ms, args.slo_tpot_ms)
    if (given[0] is None) != (given[1] is None):
        print("kvpush plot: give both --slo-ttft-ms and --slo-tpot-ms, or neither", file=sys.stderr)
        return 2
    try:
        slo = SloConfig(*given) if given[0] is not None else None
    except ValueError as e:
        print(f"kvpush plot: {e}", file=sys.stderr)
        return 2
    return plot.main(Path(args.results_dir), args.stat, slo)


def _serve(args: argparse.Namespace) -> int:
    from kvpush.launch import stack

    spec = stack.spec_from_args(args)
    describe = Path(args.describe_to) if args.describe_to else None
    return stack.serve(spec, describe)


def _up(args: argparse.Namespace) -> int:
    from kvpush.launch import stack

    return stack.up(
        args.model,
        args.connector,
        args.prefill,
        args.decode,
        args.port,
        args.detach,
        pin_cores=args.pin_cores,
        in_process=args.in_process_executor,
        first_token=args.first_token,
        disaggregation=args.disaggregation,
        front_end=args.front_end,
        connector_extra=args.connector_extra,
    )


def _ray_up(args: argparse.Namespace) -> int:
    from kvpush.ray import RayUnavailable, check_ray

    try:
        check_ray()  # before building anything
        from kvpush.ray.app import RayStack, up

        model = args.model
        if model is None:
            from kvpush.launch import tinymodel

            model = str(tinymodel.ensure())
        stack = RayStack(
            model,
            num_prefill=args.prefill,
            num_decode=args.decode,
            max_prefill=args.max_prefill,
            max_decode=args.max_decode,
            on_cpu=not _has_cuda(),
        )
        return up(stack, port=args.port)
    except (RayUnavailable, ValueError) as e:
        print(f"kvpush ray up: {e}", file=sys.stderr)
        return 2


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _down(args: argparse.Namespace) -> int:
    from kvpush.launch import stack

    return stack.down()


def _demo(args: argparse.Namespace) -> int:
    from kvpush.bench import demo

    return demo.main()


def connector_extra(text: str) -> dict:
    """--connector-extra: a JSON object of kvpush's settings (kv_connector_extra_config),
    checked before anything starts."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    from kvpush.vllm.config import read_extra

    try:
        read_extra(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def connector_extra_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connector-extra",
        type=connector_extra,
        default="{}",
        metavar="JSON",
        help="kvpush engines: JSON merged into kv_connector_extra_config",
    )


def engine_flags(parser: argparse.ArgumentParser) -> None:
    """How each engine a command starts runs: pinned to its cores (CPU), and vLLM's executor."""
    parser.add_argument(
        "--pin-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: each engine's whole process tree on its cores, not only its OpenMP threads",
    )
    parser.add_argument(
        "--in-process-executor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's in-process executor (the worker in the engine core's process, no "
        "spinning queue between them; TP 1 only). Default: kvpush's own engines on CPU at TP "
        "1; one plain engine and vLLM's connectors keep vLLM's choice",
    )


class Parser(argparse.ArgumentParser):
    """Each option that takes a value names its default in `--help` (argparse's
    `%(default)s`), unless it has none (no value, an empty list) or its help names it."""

    def add_argument(self, *args: Any, **kw: Any) -> argparse.Action:
        text, default = kw.get("help"), kw.get("default")
        takes_value = kw.get("action") in (None, "store", argparse.BooleanOptionalAction)
        if (
            isinstance(text, str)
            and takes_value
            and "default" not in text
            and default not in (None, [], "", math.inf)
        ):
            kw["help"] = f"{text} (default: %(default)s)"
        return super().add_argument(*args, **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvpush",
        description="Push-mode KV-cache transfer for prefill/decode disaggregated vLLM serving.",
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=Parser
    )

    model = sub.add_parser("model", help="build the embedded tiny model")
    model.add_argument("name", choices=["tiny"], help="which embedded model")
    model.add_argument("--out", help="folder to write (default: the kvpush cache)")
    model.set_defaults(func=_model)

    bench = sub.add_parser("bench", help="benchmarks that write JSON")
    bench_sub = bench.add_subparsers(
        dest="bench", required=True, metavar="BENCH", parser_class=Parser
    )
    transfer = bench_sub.add_parser(
        "transfer", help="push vs pull vs raw NIXL WRITE, on DRAM or a CUDA GPU"
    )
    transfer.add_argument("--quick", action="store_true", help="a subset, under a minute")
    transfer.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: DRAM, block sizes 4 KiB-1 MiB; cuda: VRAM on GPU 0, Qwen3-32B TP-8 rank shape",
    )
    transfer.add_argument("--out", help="JSON file to write")
    transfer.set_defaults(func=_bench_transfer)
    bproxy = bench_sub.add_parser("proxy", help="the proxy's added latency and requests/s")
    bproxy.add_argument("--out", help="JSON file to write")
    bproxy.add_argument(
        "--profile", help="run the proxy under cProfile, write its stats here, print the top"
    )
    bproxy.set_defaults(func=_bench_proxy)
    bttft = bench_sub.add_parser(
        "ttft", help="one request at a time: proxy vs prefill vs decode vs one plain engine"
    )
    bttft.add_argument("--out", help="JSON file to write")
    bttft.add_argument("--num-requests", type=int, default=8, help="requests per way in")
    bttft.add_argument("--prompt-tokens", type=int, default=300, help="each prompt's length")
    bttft.add_argument("--output-tokens", type=int, default=64, help="tokens each request makes")
    bttft.add_argument(
        "--qps",
        type=float,
        default=math.inf,
        help="space the requests at this rate (Poisson, one at a time); default back to back",
    )
    bttft.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="an argument for every engine, e.g. --vllm-arg=--distributed-executor-backend=uni",
    )
    connector_extra_flag(bttft)
    engine_flags(bttft)
    bttft.set_defaults(func=_bench_ttft)
    bserve = bench_sub.add_parser("serve", help="QPS x input-length sweep through a stack")
    from kvpush.bench import defaults

    bserve.add_argument(
        "--connectors",
        default=defaults.csv(defaults.MODES),
        help="stacks, in this order (default: %(default)s), from kvpush, kvpush-front-end (the "
        "kvpush stack, clients at the prefill engine's front end), nixl-push, nixl-pull, mono "
        "(one plain engine on all the stack's cores, in-process executor), mono-mp (the same, "
        "vLLM's multiprocess executor), replicas (one plain engine per stack engine, on its "
        "cores, round-robin)",
    )
    bserve.add_argument("--qps", default=defaults.csv(defaults.QPS), help="request rates")
    bserve.add_argument(
        "--input-lens", default=defaults.csv(defaults.INPUT_LENS), help="prompt tokens"
    )
    bserve.add_argument(
        "--output-lens", default=defaults.csv(defaults.OUTPUT_LENS), help="output tokens"
    )
    bserve.add_argument("--iterations", type=int, default=1, help="runs of each point")
    bserve.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="bring the stacks up in turn this many times, each round running every stack's "
        "points once: on a noisy host, connectors are then compared over interleaved runs",
    )
    bserve.add_argument(
        "--num-prompts", type=int, default=defaults.NUM_PROMPTS, help="requests a point"
    )
    bserve.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="TOKENS",
        help="prompts open with one of --num-prefixes shared prefixes of this many tokens "
        "(a prefix-cache workload: system prompts, multi-turn chat); 0: every prompt fresh",
    )
    bserve.add_argument(
        "--num-prefixes", type=int, default=0, help="shared prefixes, for --shared-prefix"
    )
    bserve.add_argument(
        "--seed",
        type=int,
        help="the prompts' seed (default: a new one each run, printed and recorded, so no "
        "engine has seen a prompt before); the same seed sends the same prompts",
    )
    bserve.add_argument(
        "--slo-ttft-ms", type=float, default=defaults.SLO_TTFT_MS, help="goodput's TTFT target"
    )
    bserve.add_argument(
        "--slo-tpot-ms", type=float, default=defaults.SLO_TPOT_MS, help="goodput's TPOT target"
    )
    bserve.add_argument(
        "--results-dir",
        default=f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}",
        help="JSON goes here (default: a new folder results/bench-<date>-<time>); a folder "
        "that already holds results is refused, unless --append",
    )
    bserve.add_argument(
        "--append", action="store_true", help="add to a results folder that holds results"
    )
    bserve.add_argument("--model", help="default: the embedded tiny model")
    bserve.add_argument(
        "--url", help="benchmark this running endpoint (a stack started elsewhere) instead"
    )
    bserve.add_argument("--mode", help="with --url: the name its results are saved under")
    bserve.add_argument(
        "--tokenizer", help="for vllm bench serve's prompts (default: --model, or the tiny model)"
    )
    bserve.add_argument(
        "--served-model-name", default="tiny", help="with --url: the model name it serves"
    )
    bserve.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="with --url: an engine whose vLLM /metrics give its prefix-cache hits during "
        "each point (repeatable; default: --url itself)",
    )
    bserve.add_argument(
        "--vllm-arg", action="append", default=[], help="an argument for every engine started"
    )
    connector_extra_flag(bserve)
    engine_flags(bserve)
    bserve.set_defaults(func=_bench_serve)

    from kvpush.bench.chaos import ChaosConfig
    from kvpush.proxy.config import DISAGGREGATION

    bchaos = bench_sub.add_parser(
        "chaos",
        help="Poisson load on a local stack while its engines are killed and restarted at "
        "random; what every request got (JSON)",
    )
    bchaos.add_argument("--duration-s", type=float, default=ChaosConfig.duration_s)
    bchaos.add_argument("--qps", type=float, default=ChaosConfig.qps)
    bchaos.add_argument("--prefill", type=int, default=ChaosConfig.num_prefill)
    bchaos.add_argument("--decode", type=int, default=ChaosConfig.num_decode)
    bchaos.add_argument(
        "--kill-every-s",
        type=float,
        default=ChaosConfig.kill_every_s,
        help="mean seconds between kills (default: %(default)s); 0: none, an overload run",
    )
    bchaos.add_argument("--max-tokens", type=int, default=ChaosConfig.max_tokens)
    bchaos.add_argument(
        "--request-timeout-s",
        type=float,
        default=ChaosConfig.request_timeout_s,
        help="a request not ended by then counts as failed (default: %(default)s)",
    )
    bchaos.add_argument("--min-input-len", type=int, default=ChaosConfig.min_input_len)
    bchaos.add_argument("--max-input-len", type=int, default=ChaosConfig.max_input_len)
    bchaos.add_argument(
        "--disaggregation",
        choices=DISAGGREGATION,
        default="always",
        help="the proxy's (default: always, so that every request takes the push path and "
        "its failures; the product's default, auto, mostly serves plain on 2 cores)",
    )
    bchaos.add_argument("--seed", type=int, help="default: a new one, recorded")
    bchaos.add_argument("--model", help="default: the embedded tiny model")
    bchaos.add_argument(
        "--results-dir",
        default=f"results/chaos-{time.strftime('%Y%m%d-%H%M%S')}",
        help="chaos.json and the engines' logs go here",
    )
    bchaos.set_defaults(func=_bench_chaos)

    plot = sub.add_parser("plot", help="figures and summary.md from bench serve results")
    plot.add_argument("results_dir")
    plot.add_argument(
        "--stat", choices=["mean", "median", "p99"], default="median", help="for summary.md"
    )
    for name in ("ttft", "tpot"):
        plot.add_argument(
            f"--slo-{name}-ms",
            type=float,
            help=f"SLO attainment's {name.upper()} target (default: the one each result was "
            "run with; needed for results from vLLM's own bench serve)",
        )
    plot.set_defaults(func=_plot)

    plan_p = sub.add_parser(
        "plan", help="from a running proxy's measurements: disaggregate or not, and the P:D split"
    )
    plan_p.add_argument("--url", default="http://127.0.0.1:8000", help="the kvpush proxy")
    plan_p.add_argument(
        "--slo-ttft-ms", type=float, default=defaults.SLO_TTFT_MS, help="the TTFT target"
    )
    plan_p.add_argument(
        "--slo-tpot-ms", type=float, default=defaults.SLO_TPOT_MS, help="the TPOT target"
    )
    plan_p.add_argument(
        "--last", type=int, help="only the newest N requests (default: all the proxy keeps)"
    )
    plan_p.add_argument("--json", action="store_true", help="the plan as JSON")
    plan_p.set_defaults(func=_plan)

    serve = sub.add_parser("serve", help="start one vLLM engine with the right connector config")
    serve.add_argument("--role", choices=["prefill", "decode", "mono"], required=True)
    serve.add_argument(
        "--connector",
        choices=["kvpush", "nixl-push", "nixl-pull"],
        default="kvpush",
        help="the KV connector the engine loads",
    )
    serve.add_argument("--model", help="model path or name (default: the embedded tiny model)")
    serve.add_argument("--port", type=int, default=8100, help="the engine's HTTP port")
    serve.add_argument("--kv-host", default="127.0.0.1", help="address the side channel binds")
    serve.add_argument(
        "--side-channel-port",
        type=int,
        default=5600,
        help="prefill: base port (rank r listens on +r)",
    )
    serve.add_argument("--engine-id", help="default: <role>-<port>")
    serve.add_argument("--block-size", type=int, default=32, help="CPU: a multiple of 32")
    serve.add_argument("--kv-cache-gib", type=int, default=1, help="CPU KV-cache size (GiB)")
    serve.add_argument("--cpu-bind", help="CPU OpenMP binding (default: prefill 0, decode 1)")
    serve.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on (vLLM's default), decode engines too",
    )
    serve.add_argument("--describe-to", help="write the engine's description JSON here")
    serve.add_argument(
        "--front-end-decode",
        action="append",
        default=[],
        metavar="FILE|URL[,key=value...]",
        help="kvpush prefill: also serve clients as a front end (the proxy's push dispatch in "
        "this engine's API server; docs/design/proxy.md), sending decode legs to this engine: "
        "a description JSON from `kvpush serve --describe-to`, or as `kvpush proxy --decode` "
        "takes it (repeatable)",
    )
    engine_flags(serve)
    serve.add_argument("vllm_args", nargs="*", help="after --: extra vLLM arguments")
    serve.set_defaults(func=_serve)

    up = sub.add_parser("up", help="start prefill + decode engines and the proxy locally")
    up.add_argument(
        "--connector",
        choices=["kvpush", "nixl-push", "nixl-pull"],
        default="kvpush",
        help="what the engines run",
    )
    up.add_argument("--model", help="default: the embedded tiny model")
    up.add_argument("--prefill", type=int, default=1, help="prefill engines (ports 8100...)")
    up.add_argument("--decode", type=int, default=1, help="decode engines (ports 8200...)")
    up.add_argument("--port", type=int, default=8000, help="the proxy's port")
    up.add_argument("--detach", action="store_true", help="return once ready; `kvpush down`")
    up.add_argument(
        "--no-first-token",
        dest="first_token",
        action="store_false",
        help="kvpush: the client's first token from decode's stream, not prefill's answer",
    )
    up.add_argument(
        "--disaggregation",
        choices=["auto", "always", "never"],
        default="auto",
        help="kvpush: every prompt pushed, or every engine a plain replica, whichever the "
        "proxy measures ends requests sooner (auto); always pushed; never pushed "
        "(docs/design/proxy.md, 'Conditional disaggregation')",
    )
    up.add_argument(
        "--front-end",
        action="store_true",
        help="kvpush: each prefill engine also takes clients' requests itself, no proxy between "
        "(docs/design/proxy.md, 'The front end'); the proxy still runs",
    )
    connector_extra_flag(up)
    engine_flags(up)
    up.set_defaults(func=_up)

    ray_p = sub.add_parser("ray", help="kvpush on Ray Serve LLM (the `ray` extra)")
    ray_sub = ray_p.add_subparsers(dest="ray_command", required=True)
    ray_up = ray_sub.add_parser(
        "up",
        help="Ray Serve LLM's P/D app with kvpush's connector on a local Ray instance, "
        "until Ctrl-C",
    )
    ray_up.add_argument("--model", help="default: the embedded tiny model")
    ray_up.add_argument("--prefill", type=int, default=1, help="prefill replicas")
    ray_up.add_argument("--decode", type=int, default=1, help="decode replicas")
    ray_up.add_argument(
        "--max-prefill", type=int, help="autoscale prefill up to this many (default: fixed)"
    )
    ray_up.add_argument(
        "--max-decode", type=int, help="autoscale decode up to this many (default: fixed)"
    )
    ray_up.add_argument("--port", type=int, default=8000, help="Ray Serve's HTTP port")
    ray_up.set_defaults(func=_ray_up)

    down = sub.add_parser("down", help="stop a stack started with `kvpush up --detach`")
    down.set_defaults(func=_down)

    proxy = sub.add_parser("proxy", help="the OpenAI-compatible P/D proxy")
    from kvpush.proxy.cli import add_arguments

    add_arguments(proxy)
    proxy.set_defaults(func=_proxy)

    demo = sub.add_parser("demo", help="local stack: push vs pull TTFT side by side")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvpush.settings import SETTINGS

    level = args.log_level or SETTINGS.log_level
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # SIGTERM unwinds like Ctrl-C, so every stack a command started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
