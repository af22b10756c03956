"""`kvpush <command>`: every entry point, with heavy imports deferred to the command run."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _model(args: argparse.Namespace) -> int:
    from kvpush.launch import tinymodel

    out = tinymodel.build(Path(args.out)) if args.out else tinymodel.ensure()
    print(f"{tinymodel.NAME} written to {out} (sha256 {tinymodel.digest(out)[:16]})")
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvpush.bench import transfer

    return transfer.main(quick=args.quick, out=Path(args.out) if args.out else None)


def _proxy(args: argparse.Namespace) -> int:
    from kvpush.proxy import cli

    return cli.main(args)


def _demo(args: argparse.Namespace) -> int:
    from kvpush.launch import demo

    return demo.main()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpush",
        description="Push-mode KV-cache transfer for prefill/decode disaggregated vLLM serving.",
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="build the embedded tiny model")
    model.add_argument("name", choices=["tiny"], help="which embedded model")
    model.add_argument("--out", help="folder to write (default: the kvpush cache)")
    model.set_defaults(func=_model)

    bench = sub.add_parser("bench", help="benchmarks that write JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    transfer = bench_sub.add_parser("transfer", help="push vs pull vs raw NIXL WRITE on DRAM")
    transfer.add_argument("--quick", action="store_true", help="a subset, under a minute")
    transfer.add_argument("--out", help="JSON file to write")
    transfer.set_defaults(func=_bench_transfer)

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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
