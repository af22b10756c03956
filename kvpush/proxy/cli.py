"""`kvpush proxy`: build the configuration from a file, engine files and flags; serve."""

from __future__ import annotations

import argparse
import logging

from kvpush.proxy.config import POLICIES, EngineInfo, ProxyConfig, load_engines, load_file
from kvpush.proxy.paths import DISAGGREGATION

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or TOML file: engines and settings")
    p.add_argument(
        "--engine-file",
        action="append",
        default=[],
        help="engine description JSON written by `kvpush serve` (repeatable)",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL[,key=value...]",
        help="a prefill engine, e.g. http://h:8100,engine_id=p0,kv_host=h,"
        "side_channel_port=5600,tp_size=1 (repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL[,key=value...]",
        help="a decode engine (repeatable)",
    )
    p.add_argument(
        "--connector",
        choices=["kvpush", "nixl-push", "nixl-pull"],
        default=None,
        help=f"what the engines run: push or pull dispatch (default: {ProxyConfig.connector})",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="how an engine of a role is picked: prefix-aware (the fewest prompt tokens to "
        "compute, its likely cached prefix left out; round-robin on a tie), round-robin, "
        f"least-outstanding (default: {ProxyConfig.policy})",
    )
    p.add_argument(
        "--max-decode-prompt-tokens",
        type=int,
        default=None,
        help="prompt tokens a decode engine may hold for requests in flight; beyond, a "
        "request waits --admission-wait-s for room, then 503 (default: 90%% of the engine's KV "
        "cache, from its /metrics)",
    )
    p.add_argument(
        "--max-decode-requests",
        type=int,
        default=None,
        help="requests a decode engine may hold in flight; beyond, a request waits "
        "--admission-wait-s, then 503 (default: the engine's max_num_seqs, which kvpush "
        "engines say at /kvpush/limits)",
    )
    p.add_argument(
        "--max-prefill-requests",
        type=int,
        default=None,
        help="requests a prefill engine may hold in flight; with every prefill engine at it, "
        "a pushed prompt is computed on its decode engine (default: the engine's "
        "max_num_seqs)",
    )
    p.add_argument(
        "--admission-wait-s",
        type=float,
        default=None,
        help="how long a request waits for a decode engine with room before 503 "
        f"(default: {ProxyConfig.admission_wait_s:g})",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help=f"each engine leg's time limit (default: {ProxyConfig.request_timeout_s:g} s)",
    )
    p.add_argument(
        "--no-first-token",
        dest="first_token",
        action="store_const",
        const=False,
        default=None,
        help="kvpush: the client's first token comes from decode's stream, not prefill's "
        "answer (default: from prefill, where the decode engine declares forces_first_token)",
    )
    p.add_argument(
        "--disaggregation",
        choices=DISAGGREGATION,
        default=None,
        help="kvpush: disaggregate where it pays, measured: every prompt pushed, or every "
        "engine a plain replica, whichever recent requests say ends requests sooner (auto); "
        "push every "
        "prompt (always); push none: every engine serves whole requests, as plain replicas "
        "(never) "
        f"(default: {ProxyConfig.disaggregation})",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=None,
        help="times a stream whose engine fails mid-answer may continue on another engine; "
        f"0: never, the stream ends with an error event (default: {ProxyConfig.max_migrations})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the proxy listens on")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port")


def parse_engine(spec: str, role: str) -> EngineInfo:
    url, *pairs = spec.split(",")
    fields: dict = {"url": url, "role": role}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in EngineInfo.__dataclass_fields__:
            raise ValueError(
                f"bad engine option {pair!r} in {spec!r}; known: "
                f"{sorted(EngineInfo.__dataclass_fields__)}"
            )
        fields[key] = parse_value(key, value)
    return EngineInfo(**fields)


def parse_value(key: str, value: str) -> str | int | bool:
    if key in ("side_channel_port", "tp_size", "pp_size"):
        return int(value)
    if key == "forces_first_token":
        if value.lower() not in ("true", "false"):
            raise ValueError(f"forces_first_token must be true or false, got {value!r}")
        return value.lower() == "true"
    return value


def decode_engines(specs: list[str]) -> list[EngineInfo]:
    """Decode engines from description files (`kvpush serve --describe-to`) or
    URL[,key=value...] as --decode takes them."""
    engines = []
    for spec in specs:
        if spec.startswith(("http://", "https://")):
            engines.append(parse_engine(spec, "decode"))
        else:
            engines += load_engines([spec])
    for e in engines:
        if e.role != "decode":
            raise ValueError(f"{e.url} is a {e.role} engine, not a decode engine")
    return engines


def build_config(args: argparse.Namespace) -> ProxyConfig:
    settings = load_file(args.config) if args.config else {"engines": []}
    engines = list(settings.pop("engines"))
    engines += load_engines(args.engine_file)
    engines += [parse_engine(s, "prefill") for s in args.prefill]
    engines += [parse_engine(s, "decode") for s in args.decode]
    names = (
        "connector",
        "policy",
        "max_decode_prompt_tokens",
        "max_decode_requests",
        "max_prefill_requests",
        "admission_wait_s",
        "request_timeout_s",
        "first_token",
        "disaggregation",
        "max_migrations",
    )
    for name in names:
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    return ProxyConfig(engines=tuple(engines), **settings)


def main(args: argparse.Namespace) -> int:
    from kvpush.proxy.app import serve

    config = build_config(args)
    log.info(
        "kvpush proxy (%s, %s) on http://%s:%d: %s",
        config.mode,
        config.connector,
        args.host,
        args.port,
        ", ".join(f"{e.role} {e.url}" for e in config.engines),
    )
    serve(config, args.host, args.port)
    return 0
