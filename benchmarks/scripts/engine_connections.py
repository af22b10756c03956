"""TCP connections the engines accept besides the client's own, and each API server's CPU, while
streamed requests arrive one at a time at Poisson 1/s (the default grid's lowest load).

Starts `kvpush up --front-end --detach` (prefill, decode, the proxy), sends REQUESTS streamed
requests of 256 random token ids and 16 output tokens to TARGET (`front-end`: the prefill
engine's front end; `proxy`), then `kvpush down`. The client opens a new connection per request
(force_close), so the host's passive TCP opens (/proc/net/snmp) less REQUESTS are those the
proxy's and the front end's pools (legs and health checks) made the engines accept.

Run on this host: python benchmarks/scripts/engine_connections.py OUT.json [TARGET [SEED]]
"""

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REQUESTS, PROMPT, OUTPUT = 40, 256, 16
PORTS = {"prefill": 8100, "decode": 8200, "proxy": 8000}
KVPUSH = os.path.join(os.path.dirname(sys.executable), "kvpush")


def passive_opens() -> int:
    lines = Path("/proc/net/snmp").read_text().splitlines()
    rows = [line.split() for line in lines if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("PassiveOpens")])


def pid_on(port: int) -> int:
    out = subprocess.run(["ss", "-ltnp", f"sport = :{port}"], capture_output=True, text=True)
    return int(out.stdout.split("pid=")[1].split(",")[0])


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, seed: int) -> list[float]:
    rng = random.Random(seed)
    ttfts = []
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        for _ in range(REQUESTS):
            prompt = [rng.randint(10, 900) for _ in range(PROMPT)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT, "stream": True}
            t0, first = time.perf_counter(), None
            async with s.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter()
            ttfts.append(first - t0)
            await asyncio.sleep(rng.expovariate(1.0))
    return ttfts


def main() -> None:
    out = sys.argv[1]
    target = sys.argv[2] if len(sys.argv) > 2 else "front-end"
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    url = f"http://127.0.0.1:{PORTS['prefill' if target == 'front-end' else 'proxy']}"
    subprocess.run([KVPUSH, "up", "--front-end", "--detach"], check=True, capture_output=True)
    try:
        asyncio.run(drive(url, seed + 1000))  # warm-up, not counted
        pids = {role: pid_on(port) for role, port in PORTS.items()}
        cpu0, opens0, t0 = {r: cpu_s(p) for r, p in pids.items()}, passive_opens(), time.time()
        ttfts = sorted(asyncio.run(drive(url, seed)))
        cpu1, opens1, t1 = {r: cpu_s(p) for r, p in pids.items()}, passive_opens(), time.time()
    finally:
        subprocess.run([KVPUSH, "down"], capture_output=True)
    result = {
        "target": target,
        "requests": REQUESTS,
        "seconds": round(t1 - t0, 1),
        "engine_accepts_besides_client": opens1 - opens0 - REQUESTS,
        "cpu_ms_per_request": {r: round((cpu1[r] - cpu0[r]) / REQUESTS * 1000, 2) for r in pids},
        "ttft_median_ms": round(ttfts[REQUESTS // 2] * 1000, 1),
    }
    print(json.dumps(result))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
