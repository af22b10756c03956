"""Where each request's CPU goes, process by process, on both engines' cores (issue 10).

Starts the local kvpush stack with the front end (as `kvpush bench ttft`), then sends
streamed requests of 300 random token ids and 64 output tokens, one at a time, in rounds
(each kind once per round, shuffled, 1.5-2.5 s apart): straight to the prefill engine
(`direct`, the front end told to step aside), through the front end (`front_end`) and
through the proxy (`proxy`). Around each request it reads every thread's CPU time
(/proc/PID/task/TID/schedstat, nanoseconds on a CPU) of both engines' process trees and of
the proxy, at the send, at the client's first token, at the end of the stream and 1 s
later. Threads are grouped by process (vLLM names them: the API server is `python`,
`VLLM::EngineCore`, `VLLM::Worker`), and the worker's main thread (its model runner) apart
from its other threads (kvpush's endpoint thread, ZMQ's, gloo's).

Windows: `to_first_token` (send -> the client's first token), `stream` (-> the end),
`after` (the next second). Medians over ROUNDS rounds after two not counted, ms of CPU.
Reading /proc takes the client a few ms at each mark, so its TTFT is not a figure here.

Run on this host: python benchmarks/scripts/core_cpu.py OUT.json [CONNECTOR_EXTRA_JSON]
"""

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import psutil

from kvpush import httpclient
from kvpush.proxy.frontend import OFF_HEADER

ROUNDS = 12
WINDOWS = ("to_first_token", "stream", "after")


def _group(role: str, proc: psutil.Process, tid: int) -> str:
    name = Path(f"/proc/{proc.pid}/comm").read_text().strip()
    if role == "proxy":
        return "proxy/proxy"
    name = {"python": "api_server", "VLLM::EngineCor": "engine_core"}.get(name, name)
    if name == "VLLM::Worker":
        name = "worker_main" if tid == proc.pid else "worker_other_threads"
    return f"{role}/{name}"


def snapshot(roots: dict[str, int]) -> dict[tuple[str, int], int]:
    """(group, tid) -> ns on a CPU, for every thread under each root process."""
    out = {}
    for role, pid in roots.items():
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            for task in Path(f"/proc/{proc.pid}/task").iterdir():
                try:
                    ns = int((task / "schedstat").read_text().split()[0])
                except (OSError, ValueError):
                    continue  # the thread ended meanwhile
                out[(_group(role, proc, int(task.name)), int(task.name))] = ns
    return out


def by_group(a: dict, b: dict) -> dict[str, float]:
    """ms of CPU per group between two snapshots."""
    out: dict[str, float] = {}
    for key, ns in b.items():
        out[key[0]] = out.get(key[0], 0.0) + (ns - a.get(key, 0)) / 1e6
    return out


async def one(c, url: str, headers: dict, prompt: list[int], roots: dict) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    marks = [snapshot(roots)]
    async with c.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for event in httpclient.sse_events(r):
            if len(marks) == 1 and event.get("choices"):
                marks.append(snapshot(roots))
    marks.append(snapshot(roots))
    await asyncio.sleep(1.0)
    marks.append(snapshot(roots))
    return {w: by_group(marks[i], marks[i + 1]) for i, w in enumerate(WINDOWS)}


async def run(stack) -> dict:
    rng = random.Random(11)
    prefill = stack.specs[0].url
    roots = {"prefill": stack.engines[0].proc.pid, "decode": stack.engines[1].proc.pid,
             "proxy": stack.proxy.pid}  # fmt: skip
    targets = {"direct": (prefill, {OFF_HEADER.decode(): "off"}), "front_end": (prefill, {}),
               "proxy": (stack.url, {})}  # fmt: skip
    res: dict[str, list] = {k: [] for k in targets}
    async with httpclient.session() as c:
        for i in range(2 + ROUNDS):
            kinds = list(targets)
            rng.shuffle(kinds)
            for kind in kinds:
                url, headers = targets[kind]
                prompt = [rng.randrange(3, 4096) for _ in range(300)]
                got = await one(c, url, headers, prompt, roots)
                if i >= 2:
                    res[kind].append(got)
                await asyncio.sleep(0.5 + rng.random())
            print(f"  round {i + 1} of {2 + ROUNDS}", flush=True)
    return res


def medians(rows: list[dict]) -> dict:
    out = {}
    for w in WINDOWS:
        groups = sorted({g for r in rows for g in r[w]})
        out[w] = {g: round(float(np.median([r[w].get(g, 0.0) for r in rows])), 2) for g in groups}
    return out


def main(out: str, extra: dict) -> None:
    from kvpush.launch import tinymodel
    from kvpush.launch.stack import PROXY_PORT, Stack, stack_specs
    from kvpush.settings import SETTINGS

    specs = stack_specs(str(tinymodel.ensure()), "kvpush", 1, 1, connector_extra=extra)
    stack = Stack(specs, "kvpush", PROXY_PORT, SETTINGS.cache_dir / "logs", front_end=True)
    stack.start()
    try:
        res = asyncio.run(run(stack))
    finally:
        stack.stop()
    med = {kind: medians(rows) for kind, rows in res.items()}
    for kind, windows in med.items():
        for w, groups in windows.items():
            shown = ", ".join(f"{g} {v:.2f}" for g, v in groups.items() if v >= 0.05)
            print(f"{kind:9} {w:14} {shown}")
    result = {"benchmark": "core_cpu", "connector_extra": extra, "medians_ms": med, "runs": res}
    result["created_unix_s"] = int(time.time())
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
