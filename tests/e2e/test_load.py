"""Many requests at once on the shared pair: byte-exact transfers, outputs equal to a plain
engine's (up to near-ties), random aborts that leave nothing held, and idle CPU."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from urllib.parse import urlsplit

import pytest

from kvpush.httpclient import KEEPALIVE_EXPIRY_S
from kvpush.proxy.app import create_app
from kvpush.proxy.config import EngineInfo, ProxyConfig
from tests.e2e.client import (
    abort_after,
    assert_same_or_near_tie,
    body,
    describe,
    disagg,
    kvpush_warnings,
    metric_samples,
    post,
    reference_and_disagg,
    session,
    tcp_counters,
    tokens,
    wait_idle,
)
from tests.servers import open_connections, run_server

pytestmark = pytest.mark.e2e


def count(path, needle: str) -> int:
    return path.read_bytes().count(needle.encode())


def test_32_concurrent_are_byte_exact_and_match_the_plain_engine(pair, mono_url, engines):
    decode_log = engines["decode"].log_path
    ok_before = count(decode_log, "checksum ok")
    prompts = [tokens(random.Random(i).randrange(50, 1500), 100 + i) for i in range(32)]

    wants, gots = asyncio.run(reference_and_disagg(pair, mono_url, prompts, 16))
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=5)
    assert count(decode_log, "checksum ok") - ok_before == 32
    assert count(decode_log, "checksum mismatch") == 0
    for want, got in zip(wants, gots, strict=True):
        assert_same_or_near_tie(want, got)


def test_500_requests_with_random_aborts_leave_nothing_held(pair, engines):
    """Through the proxy, as users send them: 500 streamed requests, 16 at a time, 30 % of them
    dropped by the client at a random moment. Every request that is not dropped succeeds, none
    is re-sent (no prefill engine failed), both engines end at zero KV use with no lease
    expired, and no TCP connection is left open to an engine or to the proxy (read from the
    kernel, not from any client's pool), once idle connections have expired, but for the one
    per engine the proxy's health checks keep alive. aiohttp closes an idle pooled connection
    at the first of its clean-ups (one per keep-alive period, 4 s) after the connection has
    been idle a whole period, so one may live up to two periods; vLLM's server closes at 5 s. A
    failure names each failed request and its cause, with the host's TCP
    counters and the engines' last kvpush warnings."""
    rng = random.Random(42)
    prefill_log = engines["prefill"].log_path
    log_start = prefill_log.stat().st_size
    infos = (
        EngineInfo(pair.prefill_url, "prefill", pair.prefill_engine_id, "127.0.0.1",
                   pair.side_channel_port),
        EngineInfo(pair.decode_url, "decode", "decode", forces_first_token=True),
    )  # fmt: skip
    engine_ports = {urlsplit(u).port for u in (pair.prefill_url, pair.decode_url)}

    async def one(c, url, sem, i):
        async with sem:
            b = body(tokens(rng.randrange(20, 400), 1000 + i), 4, stream=True)
            aborted = rng.random() < 0.3
            try:
                if aborted:
                    await abort_after(post(c, url, b), rng.uniform(0.0, 0.4))
                else:
                    await post(c, url, b)
            except Exception as e:
                return f"request {i} ({'aborted' if aborted else 'completed'}): {describe(e)}"

    async def go(url):
        sem = asyncio.Semaphore(16)
        async with session(64) as c:
            results = await asyncio.gather(
                *(one(c, url, sem, i) for i in range(500)), return_exceptions=True
            )
            await asyncio.sleep(2 * KEEPALIVE_EXPIRY_S + 1)  # past both (docstring)
            left = open_connections(os.getpid(), engine_ports | {urlsplit(url).port})
            # The proxy's health checks (every 2 s) keep one connection per engine alive.
            for port in engine_ports:
                health = [c for c in left if c.endswith(f":{port}")][:1]
                left = [c for c in left if c not in health]
        failed = [describe(r) if isinstance(r, BaseException) else r for r in results]
        return [f for f in failed if f is not None], left

    tcp_before = tcp_counters()
    with run_server(create_app(ProxyConfig(engines=infos, disaggregation="always"))) as url:
        failed, left = asyncio.run(go(url))
        proxy = metric_samples(url)
    tcp = {k: v - tcp_before.get(k, 0) for k, v in tcp_counters().items()}
    logs = (engines["prefill"].log_path, engines["decode"].log_path)
    diagnosis = f"TCP counters during the run: {tcp}\n{kvpush_warnings(*logs, last=20)}"
    assert not failed, f"{len(failed)} failed: {failed[:6]}\n{diagnosis}"
    assert left == [], f"connections left open: {left}"
    assert proxy.get("kvpush_proxy_rerouted_total", 0) == 0
    assert proxy["kvpush_proxy_abandoned_total"] > 0  # some drops came before decode's answer
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=15)
    expired = [
        line
        for line in prefill_log.read_bytes()[log_start:].decode(errors="replace").splitlines()
        if "lease expired" in line
    ]
    assert not expired, expired[:5]


def _tree_cpu_s(pgid: int) -> float:
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5, pgrp
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


# Where a test only needs to start from idle engines, it waits out a lease (30 s) that an earlier
# failure may have left running, and steps an engine whose gauges that lease left stale, so one
# failure does not cascade.
SETTLE_S = 40


def test_idle_engine_with_kvpush_costs_what_a_plain_engine_costs(engines, pair):
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=SETTLE_S, step_stale=True)
    time.sleep(2)  # past the last engine step
    kvpush, mono = engines["prefill"].proc.pid, engines["mono"].proc.pid  # both on core 0
    before = {pid: _tree_cpu_s(pid) for pid in (kvpush, mono)}
    time.sleep(5)
    used = {pid: (_tree_cpu_s(pid) - before[pid]) / 5 for pid in (kvpush, mono)}
    assert used[kvpush] - used[mono] < 0.05, f"kvpush {used[kvpush]:.1%}, plain {used[mono]:.1%}"


def test_cpu_is_idle_within_1s_of_the_last_transfer_and_its_cost_while_a_lease_runs(
    engines, pair, capsys
):
    """Within 1 s of the last transfer the prefill engine is idle again. While prefill holds
    blocks nobody registered for (a lease), vLLM keeps its engine loop stepping; with vLLM's
    in-process executor (kvpush's default on CPU) those empty steps wait on the transfer
    instead of spinning, and the engine stays under half a core (0.99 core with vLLM's
    multiprocess executor, whose worker and engine core spin; docs/design/connector.md, "Idle
    cost"). Printed: the benchmark log quoted them ("CPU while idle",
    `git show 1df146f:docs/benchmarks.md`)."""
    import json

    from tests.e2e.client import decode_params, post_sync, prefill_params

    prefill = engines["prefill"].proc.pid
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=SETTLE_S, step_stale=True)

    async def one():
        async with session() as c:
            await disagg(c, pair, tokens(300, 77), 4)

    asyncio.run(one())
    time.sleep(1.0)
    before = _tree_cpu_s(prefill)
    time.sleep(3)
    after_transfer = (_tree_cpu_s(prefill) - before) / 3
    tid, prompt = uuid.uuid4().hex, tokens(300, 78)
    b = body(prompt, 1, kv_transfer_params=prefill_params(tid))
    post_sync(pair.prefill_url, b)
    before = _tree_cpu_s(prefill)
    time.sleep(3)  # the lease (30 s) is running: blocks held, no registration
    lease = (_tree_cpu_s(prefill) - before) / 3
    b = body(prompt, 2, kv_transfer_params=decode_params(pair, tid))  # now decode registers
    post_sync(pair.decode_url, b)
    wait_idle(pair.prefill_url, pair.decode_url, timeout_s=5)
    with capsys.disabled():
        print(
            json.dumps(
                {
                    "prefill_cpu_idle_after_transfer_cores": round(after_transfer, 4),
                    "prefill_cpu_while_lease_pending_cores": round(lease, 4),
                }
            )
        )
    assert after_transfer < 0.05
    assert lease < 0.5, f"{lease:.2f} core while a lease ran"
