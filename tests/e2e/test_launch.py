"""`kvpush serve` starts each of the three connectors; one request goes through a 1P1D pair
behind the proxy, which reads the description files `kvpush serve` writes. Then `kvpush up`
and `kvpush down` leave no process and no listening port behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvpush.launch.engine import group_alive, stop_group, wait_http
from tests.e2e.conftest import free_port
from tests.servers import free_port as free_proxy_port

pytestmark = pytest.mark.e2e
KVPUSH = [sys.executable, "-m", "kvpush.cli"]


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop each process group and wait until all of it is gone, not only its leader: a vLLM
    worker left behind with NIXL's progress thread would spin a core through later tests."""
    for p in procs:  # all at once; stop_group then waits for each
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        assert stop_group(p.pid, 30), f"process group {p.pid} outlived SIGKILL"
        p.wait()


@pytest.mark.parametrize("connector", ["kvpush", "nixl-pull", "nixl-push"])
def test_serve_each_connector_and_send_one_request(connector, tiny_model, tmp_path):
    procs, side = [], free_port()
    ports = {"prefill": free_port(), "decode": free_port()}
    logs = []
    try:
        for role, port in ports.items():
            desc = tmp_path / f"{role}.json"
            cmd = KVPUSH + [
                "serve",
                "--role",
                role,
                "--connector",
                connector,
                "--model",
                str(tiny_model),
                "--port",
                str(port),
                "--side-channel-port",
                str(side if role == "prefill" else free_port()),
                "--describe-to",
                str(desc),
            ]
            log = open(tmp_path / f"{role}.log", "wb")  # noqa: SIM115
            logs.append(log)
            procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        for port in ports.values():
            wait_http(f"http://127.0.0.1:{port}/health", 600, procs)
        first_line = (tmp_path / "prefill.log").read_text().splitlines()[0]
        assert first_line.startswith("kvpush serve: VLLM_CPU_KVCACHE_SPACE=1")
        assert "VLLM_USE_AOT_COMPILE=0" in first_line
        for role in ports:  # vLLM's AOT cache, on, fails to load here and compiles again
            assert "due to a load failure" not in (tmp_path / f"{role}.log").read_text()
        assert "--block-size 32" in first_line and "VLLM_CPU_OMP_THREADS_BIND=0" in first_line
        assert json.loads((tmp_path / "prefill.json").read_text())["side_channel_port"] == side
        # only kvpush decode engines force the first token, so only they may get it early
        decode_desc = json.loads((tmp_path / "decode.json").read_text())
        assert decode_desc["forces_first_token"] == (connector == "kvpush")
        proxy_port = free_proxy_port()
        proxy = subprocess.Popen(
            KVPUSH
            + [
                "proxy",
                "--connector",
                connector,
                "--port",
                str(proxy_port),
                "--engine-file",
                str(tmp_path / "prefill.json"),
                "--engine-file",
                str(tmp_path / "decode.json"),
            ]
            # the 1P1D pair's push path (kvpush's default, auto, starts as plain replicas)
            + (["--disaggregation", "always"] if connector == "kvpush" else []),
            start_new_session=True,
        )
        procs.append(proxy)
        url = f"http://127.0.0.1:{proxy_port}"
        wait_http(url + "/health", 60, procs)
        request = {
            "model": "tiny",
            "prompt": "Hello there",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        # vLLM's own NIXL connectors spin a progress thread per agent, a core each, so on this
        # 2-core host everything else in those engines starves. vLLM's push connector then
        # loses requests: its prefill worker gives up on the handshake with decode after 5 s
        # (`push_handshake_failed` or `handshake_setup_failed`, zmq.Again), and the decode leg
        # waits until the client leaves. It has lost two in a row here, and once all three
        # tries. Up to three tries for it, each bounded; kvpush gets one.
        tries, timeout = (3, 60) if connector == "nixl-push" else (1, 150)
        for attempt in range(tries):
            try:
                r = httpx.post(url + "/v1/completions", timeout=timeout, json=request)
                break
            except httpx.ReadTimeout:
                if attempt < tries - 1:
                    continue
                if connector != "nixl-push" or not vllm_push_handshake_failed(tmp_path):
                    raise
                # What `kvpush serve` and the proxy control still held: both engines came up
                # with vLLM's push connector in their roles, and the proxy's prefill legs were
                # answered. Only vLLM's own handshake, named in prefill's log, failed.
                decode_line = (tmp_path / "decode.log").read_text().splitlines()[0]
                assert '"NixlPushConnector", "kv_role": "kv_consumer"' in decode_line
                prefill_log = (tmp_path / "prefill.log").read_text()
                assert prefill_log.count('"POST /v1/completions HTTP/1.1" 200') >= 1
                # Reported as an expected failure of vLLM's connector, not as a pass (a warning
                # would not do: the suite turns warnings into errors).
                pytest.xfail(
                    "vLLM's NixlPushConnector lost all three requests: its handshake with "
                    "decode timed out (see docs/architecture.md)"
                )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        stop(procs)
        for log in logs:
            log.close()


def vllm_push_handshake_failed(tmp_path) -> bool:
    log = (tmp_path / "prefill.log").read_text(errors="replace")
    return "push_handshake_failed" in log or "handshake_setup_failed" in log


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_up_and_down_leave_no_process_and_no_port(tmp_path):
    env = dict(os.environ, KVPUSH_CACHE_DIR=str(tmp_path / "cache"))
    ports = [8000, 8100, 8200, 5600]
    if any(listening(p) for p in ports):
        pytest.skip(f"one of the stack's fixed ports {ports} is taken on this machine")
    up = subprocess.run(
        KVPUSH + ["up", "--detach"], env=env, capture_output=True, text=True, timeout=900
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert "kvpush ready: http://127.0.0.1:8000" in up.stdout
    state = json.loads((tmp_path / "cache" / "stack.json").read_text())
    r = httpx.post(
        "http://127.0.0.1:8000/v1/completions",
        timeout=120,
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 4},
    )
    assert r.status_code == 200
    down = subprocess.run(KVPUSH + ["down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not any(group_alive(pgid) for pgid in state["pgids"])
    time.sleep(1)
    assert not any(listening(p) for p in ports), [p for p in ports if listening(p)]


def test_up_says_which_engine_died_and_serves_on_with_the_rest(tmp_path):
    """`kvpush up` in the foreground: the decode engine killed, `up` names it, its exit code
    and the last error in its log, and the proxy serves the next request whole on the
    prefill engine; Ctrl-C then stops everything."""
    env = dict(os.environ, KVPUSH_CACHE_DIR=str(tmp_path / "cache"))
    ports = [8000, 8100, 8200, 5600]
    if any(listening(p) for p in ports):
        pytest.skip(f"one of the stack's fixed ports {ports} is taken on this machine")
    up = subprocess.Popen(
        KVPUSH + ["up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    out: list[str] = []

    def read_until(text: str) -> None:
        assert up.stdout is not None
        for line in up.stdout:
            out.append(line)
            if text in line:
                return
        raise AssertionError(f"`kvpush up` ended before {text!r}:\n{''.join(out)}")

    try:
        read_until("kvpush ready")
        state = json.loads((tmp_path / "cache" / "stack.json").read_text())
        prefill_pgid, decode_pgid = state["pgids"][:2]
        request = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
        assert httpx.post("http://127.0.0.1:8000/v1/completions", json=request, timeout=120)
        os.killpg(decode_pgid, signal.SIGKILL)
        read_until("exited with code")
        assert "decode engine decode-0 (http://127.0.0.1:8200) exited with code -9" in out[-1]
        read_until("the proxy serves on with prefill-0")

        def decode_down() -> bool:
            status = httpx.get("http://127.0.0.1:8000/status", timeout=5).json()
            return not any(e["healthy"] for e in status["engines"] if e["role"] == "decode")

        deadline = time.monotonic() + 30
        while not decode_down():
            assert time.monotonic() < deadline, "the proxy never saw decode go"
            time.sleep(0.5)
        r = httpx.post("http://127.0.0.1:8000/v1/completions", json=request, timeout=120)
        assert r.status_code == 200, r.text
        prom = httpx.get("http://127.0.0.1:8000/metrics", timeout=5).text
        assert 'kvpush_proxy_path_total{path="whole"} 1.0' in prom
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(120) == 0
        assert not group_alive(prefill_pgid)
    finally:
        if up.poll() is None:
            stop([up])
        assert up.stdout is not None
        up.stdout.close()
        for pgid in state["pgids"] if "state" in locals() else []:
            stop_group(pgid, 30)
