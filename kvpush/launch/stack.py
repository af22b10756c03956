"""`kvpush serve` (one engine) and `kvpush up` / `kvpush down` (a whole local stack).

`up` starts prefill engines on 8100, 8101, ... (side channels 5600, 5610, ...), decode
engines on 8200, 8201, ... and the proxy on 8000, waits for every /health, prints a ready
line, and stops everything it started on Ctrl-C, SIGTERM or `kvpush down`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpush.launch.engine import (
    Engine,
    EngineSpec,
    front_end_config,
    group_alive,
    stop_group,
    wait_http,
)
from kvpush.settings import SETTINGS

PREFILL_PORT, DECODE_PORT, PROXY_PORT = 8100, 8200, 8000
SIDE_CHANNEL_PORT, SIDE_CHANNEL_STEP = 5600, 10  # room for TP ranks: base + rank


def state_file() -> Path:
    return SETTINGS.cache_dir / "stack.json"


def serve(spec: EngineSpec, describe_to: Path | None) -> int:
    """Run one engine in the foreground; print its command; write its description."""
    print("kvpush serve:", spec.env_summary(), " ".join(spec.command()), flush=True)
    if describe_to is not None:
        describe_to.parent.mkdir(parents=True, exist_ok=True)
        describe_to.write_text(json.dumps(spec.describe(), indent=2))
        print(f"engine description written to {describe_to}", flush=True)
    proc = subprocess.Popen(spec.command(), env=spec.env())
    stop = _forward_signals(proc)
    try:
        return proc.wait()
    finally:
        stop()


def _forward_signals(proc: subprocess.Popen) -> Callable[[], object]:
    def handler(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(s, h) for s, h in old.items()]


def stack_specs(
    model: str, connector: str, num_prefill: int, num_decode: int, **engine_kw: Any
) -> list[EngineSpec]:
    specs = []
    for i in range(num_prefill):
        side = SIDE_CHANNEL_PORT + SIDE_CHANNEL_STEP * i
        specs.append(
            EngineSpec(
                "prefill",
                model,
                PREFILL_PORT + i,
                connector=connector,
                engine_id=f"prefill-{i}",
                side_channel_port=side,
                **engine_kw,
            )
        )
    for i in range(num_decode):
        side = SIDE_CHANNEL_PORT + SIDE_CHANNEL_STEP * (num_prefill + i)
        specs.append(
            EngineSpec(
                "decode",
                model,
                DECODE_PORT + i,
                connector=connector,
                engine_id=f"decode-{i}",
                side_channel_port=side,
                **engine_kw,
            )
        )
    return specs


class Stack:
    """Engines plus a proxy, all in their own process groups, stopped together."""

    def __init__(
        self,
        specs: list[EngineSpec],
        connector: str,
        proxy_port: int,
        log_dir: Path,
        with_proxy: bool = True,
        proxy_args: tuple[str, ...] = (),
        front_end: bool = False,
        proxy_cmd: list[str] | None = None,
        disaggregation: str | None = None,
    ) -> None:
        """`front_end`: each prefill engine also serves clients as a front end for all the
        decode engines (proxy/frontend.py), beside the proxy. `proxy_cmd`: another front than
        kvpush's proxy (it must serve /health on `proxy_port`), e.g. the benchmarks'
        round-robin front for plain engines. `disaggregation`: kvpush's proxy's and front
        ends' setting (None: their default, auto)."""
        if front_end:
            decodes = [s.describe() for s in specs if s.role == "decode"]
            specs = [
                front_end_config(
                    s, decodes, log_dir / f"front-end-{s.name}.json", disaggregation or "auto"
                )
                if s.role == "prefill"
                else s
                for s in specs
            ]
        self.specs, self.connector, self.proxy_port = specs, connector, proxy_port
        self.log_dir, self.with_proxy, self.proxy_args = log_dir, with_proxy, proxy_args
        self.proxy_cmd = proxy_cmd
        if disaggregation is not None:
            self.proxy_args += ("--disaggregation", disaggregation)
        self.engines: list[Engine] = []
        self.proxy: subprocess.Popen | None = None
        self._reported: set[Engine] = set()  # engines whose exit was told (newly_exited)

    @property
    def url(self) -> str:
        """Where clients go: the proxy, or the one engine of a stack without one."""
        return f"http://127.0.0.1:{self.proxy_port}" if self.with_proxy else self.specs[0].url

    def start(self, timeout_s: float = 900) -> None:
        try:
            for spec in self.specs:
                print(f"  {spec.role:7} {spec.url}  {spec.env_summary()}", flush=True)
                self.engines.append(Engine(spec, self.log_dir / f"{spec.name}.log"))
            self._write_state()
            for engine in self.engines:
                engine.wait_ready(timeout_s)
            if self.with_proxy:
                self._start_proxy()
                wait_http(self.url + "/health", 60, self.proxy, "proxy")
            self._write_state()
        except BaseException:
            self.stop()
            raise

    def _start_proxy(self) -> None:
        cmd = self.proxy_cmd or self._kvpush_proxy_cmd()
        log = open(self.log_dir / "proxy.log", "ab")  # noqa: SIM115 - child keeps it
        self.proxy = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _kvpush_proxy_cmd(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "kvpush.cli",
            "proxy",
            "--connector",
            self.connector,
            "--port",
            str(self.proxy_port),
        ]
        for spec in self.specs:  # the description files `kvpush serve --describe-to` writes
            path = self.log_dir / f"{spec.name}.json"
            path.write_text(json.dumps(spec.describe()))
            cmd += ["--engine-file", str(path)]
        return cmd + list(self.proxy_args)

    def newly_exited(self) -> list[str]:
        """A line for each engine whose process exited since the last call: which, its code,
        and why (the last error its log names)."""
        lines = []
        for engine in self.engines:
            code = engine.proc.poll()
            if code is None or engine in self._reported:
                continue
            self._reported.add(engine)
            spec = engine.spec
            why = last_error(engine.log_tail(20_000)) or "no error in its log"
            lines.append(
                f"kvpush: {spec.role} engine {spec.name} ({spec.url}) exited with code {code}: "
                f"{why}; log: {engine.log_path}"
            )
        return lines

    def _write_state(self) -> None:
        pids = [e.proc.pid for e in self.engines] + ([self.proxy.pid] if self.proxy else [])
        state_file().parent.mkdir(parents=True, exist_ok=True)
        state_file().write_text(json.dumps({"pgids": pids, "url": self.url}))

    def stop(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            stop_group(self.proxy.pid)
            self.proxy.wait()
        for engine in self.engines:
            engine.stop()
        with contextlib.suppress(FileNotFoundError):
            state_file().unlink()


def up(
    model: str | None,
    connector: str,
    num_prefill: int,
    num_decode: int,
    proxy_port: int,
    detach: bool,
    pin_cores: bool = True,
    in_process: bool | None = None,
    first_token: bool = True,
    disaggregation: str = "auto",
    front_end: bool = False,
    connector_extra: dict | None = None,
) -> int:
    from kvpush.launch import tinymodel

    if front_end and connector != "kvpush":
        print(f"--front-end runs with --connector kvpush only, not {connector}")
        return 2
    if connector_extra and connector != "kvpush":
        print(f"--connector-extra sets kvpush's own engines; --connector {connector} has none")
        return 2
    if state_file().exists():
        pgids = json.loads(state_file().read_text()).get("pgids", [])
        if any(group_alive(pgid) for pgid in pgids):
            print(f"a kvpush stack is running ({state_file()}); run `kvpush down` first")
            return 1
        state_file().unlink()  # left by a stack that died without cleaning up
    model = model or str(tinymodel.ensure())
    specs = stack_specs(
        model, connector, num_prefill, num_decode, pin_cores=pin_cores, in_process=in_process,
        connector_extra=connector_extra or {},
    )  # fmt: skip
    log_dir = SETTINGS.cache_dir / "logs"
    print(
        f"kvpush up: {num_prefill} prefill + {num_decode} decode ({connector}), logs in {log_dir}",
        flush=True,
    )
    proxy_args: tuple[str, ...] = () if first_token else ("--no-first-token",)
    stack = Stack(
        specs, connector, proxy_port, log_dir, proxy_args=proxy_args, front_end=front_end,
        disaggregation=disaggregation if connector == "kvpush" else None,
    )  # fmt: skip
    stack.start()
    print(
        f"kvpush ready: {stack.url}  try:\n  curl {stack.url}/v1/completions -H "
        '\'content-type: application/json\' -d \'{"model": "tiny", "prompt": "Hello", '
        '"max_tokens": 16}\'',
        flush=True,
    )
    if front_end:
        urls = ", ".join(s.url for s in stack.specs if s.role == "prefill")
        print(f"front end (the same requests, no proxy): {urls}", flush=True)
    if detach:
        return 0
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stopping:
            time.sleep(0.5)
            for line in stack.newly_exited():
                alive = [e.spec.name for e in stack.engines if e.proc.poll() is None]
                print(f"{line}\n  the proxy serves on with {', '.join(alive) or 'no engine'}",
                      flush=True)  # fmt: skip
    finally:
        print("kvpush: stopping the stack", flush=True)
        stack.stop()
    return 0


_ERROR = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b: .+")


def last_error(log: str) -> str | None:
    """The last `SomeError: message` line of a log, without what precedes it on the line."""
    found = _ERROR.findall(log)
    return found[-1].strip() if found else None


def down() -> int:
    try:
        state = json.loads(state_file().read_text())
    except FileNotFoundError:
        print("no kvpush stack is running")
        return 0
    for pgid in state["pgids"]:
        stop_group(pgid)
    state_file().unlink(missing_ok=True)
    print(f"stopped {len(state['pgids'])} process groups")
    return 0


def spec_from_args(args: argparse.Namespace) -> EngineSpec:
    from kvpush.launch import tinymodel

    model = args.model or str(tinymodel.ensure())
    spec = EngineSpec(
        args.role,
        model,
        args.port,
        connector=args.connector,
        engine_id=args.engine_id or "",
        kv_host=args.kv_host,
        side_channel_port=args.side_channel_port,
        block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib,
        cpu_bind=args.cpu_bind or "",
        extra_args=tuple(args.vllm_args),
        pin_cores=args.pin_cores,
        in_process=args.in_process_executor,
    )
    if args.prefix_caching is not None:
        spec = replace(spec, prefix_caching=args.prefix_caching)
    if args.front_end_decode:
        from kvpush.proxy.cli import decode_engines

        if spec.role != "prefill" or spec.connector != "kvpush":
            raise SystemExit("--front-end-decode: a kvpush prefill engine only")
        decodes = [vars(e) for e in decode_engines(args.front_end_decode)]
        path = SETTINGS.cache_dir / f"front-end-{spec.name}.json"
        spec = front_end_config(spec, decodes, path)
    return spec
