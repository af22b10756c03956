"""kvpush's Ray Serve app (kvpush.ray) on this host, run by `make test-ray`: the app started
as a user would (`kvpush ray up`), and one plain engine for the reference answers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvpush.launch.engine import Engine, EngineSpec
from tests.servers import free_port

LOG_DIR = Path(__file__).resolve().parents[2] / "results" / "e2e-logs"
READY = re.compile(r"serving on (http://\S+), the engines' metrics on (http://\S+/metrics)")


def replica_processes(role: str) -> list[psutil.Process]:
    """The Ray actors of one role's replicas (`ray::ServeReplica:kvpush:Prefill:tiny`)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if f"ServeReplica:kvpush:{role}" in cmdline:
            found.append(p)
    return found


class RayApp:
    """`kvpush ray up` in a session of its own; `stop` ends it as Ctrl-C would."""

    def __init__(self, num_prefill: int, num_decode: int) -> None:
        self.num_prefill, self.num_decode = num_prefill, num_decode
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"ray-{num_prefill}p{num_decode}d.log"
        command = [sys.executable, "-m", "kvpush.cli", "ray", "up", "--port", str(free_port()),
                   "--prefill", str(num_prefill), "--decode", str(num_decode)]  # fmt: skip
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.url = self.metrics_url = ""

    def wait_ready(self, timeout_s: float = 420) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = READY.search(self.log_path.read_text(errors="replace"))
            if found:
                self.url, self.metrics_url = found.groups()
                return
            if self.proc.poll() is not None:
                break
            time.sleep(1)
        tail = self.log_path.read_text(errors="replace")[-3000:]
        self.stop()
        raise AssertionError(f"kvpush ray up not ready (log {self.log_path}):\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def mono_url(tiny_model):
    """One plain engine: the reference answers."""
    spec = EngineSpec("mono", str(tiny_model), free_port(), engine_id="mono-ray", block_size=32)
    engine = Engine(spec, LOG_DIR / "mono-ray.log")
    try:
        engine.wait_ready()
        yield spec.url
    finally:
        engine.stop()


@pytest.fixture(scope="module", params=[(1, 1), (2, 1)], ids=["1P1D", "2P1D"])
def app(request, tiny_model, mono_url):
    """The app at each scale in turn; once it stops, none of its processes is left."""
    ray_app = RayApp(*request.param)
    ray_app.wait_ready()
    yield ray_app
    ray_app.stop()
    left = replica_processes("Prefill") + replica_processes("Decode")
    assert ray_app.proc.returncode == 0, ray_app.log_path
    assert not left, f"replicas left running: {[p.pid for p in left]}"
