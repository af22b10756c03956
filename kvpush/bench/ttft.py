"""`kvpush bench ttft`: one streamed request at a time, as a new user tries the stack.

The same prompts go through the proxy (kvpush 1P1D), straight to the prefill engine, straight
to the decode engine (which then computes the prompt itself), and to one plain engine. Medians
of TTFT and TPOT for each, and of the proxy's timeline phases (its /timelines), above all the
push tail: prefill's answer at the proxy to decode's first token at the proxy.
`--vllm-arg` adds an argument to every engine, so engine settings are compared run by run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import numpy as np

from kvpush import httpclient
from kvpush.bench.load import one_request, random_prompt


async def _sequential(url: str, prompts: list[list[int]], output_len: int) -> list:
    async with httpclient.session() as c:
        return [await one_request(c, url, "tiny", p, output_len) for p in prompts]


async def _timelines(url: str) -> list[dict]:
    async with httpclient.session() as c, c.get(url + "/timelines") as r:
        return (await r.json())["timelines"]


def _summary(results: list) -> dict:
    ok = [r for r in results if r.ok]
    if len(ok) < len(results):
        errors = [r.error for r in results if not r.ok]
        raise RuntimeError(f"{len(results) - len(ok)} requests failed: {errors[:3]}")
    return {
        "median_ttft_ms": float(np.median([r.ttft_ms for r in ok])),
        "median_tpot_ms": float(np.median([r.tpot_ms for r in ok])),
    }


def main(
    out: Path | None,
    num_requests: int = 8,
    prompt_tokens: int = 300,
    output_tokens: int = 64,
    vllm_args: tuple[str, ...] = (),
) -> int:
    from kvpush.bench.serve import hardware
    from kvpush.launch import tinymodel
    from kvpush.launch.engine import EngineSpec
    from kvpush.launch.stack import DECODE_PORT, PROXY_PORT, Stack, stack_specs
    from kvpush.settings import SETTINGS

    model = str(tinymodel.ensure())
    rng = random.Random(0)
    prompts = [random_prompt(prompt_tokens, rng) for _ in range(num_requests)]
    warm = [random_prompt(prompt_tokens, rng) for _ in range(3)]
    log_dir = SETTINGS.cache_dir / "logs"
    result: dict = {"benchmark": "ttft", "num_requests": num_requests, "vllm_args": vllm_args}
    result |= {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens}

    specs = stack_specs(model, "kvpush", 1, 1, extra_args=tuple(vllm_args))
    stack = Stack(specs, "kvpush", PROXY_PORT, log_dir)
    print(f"kvpush bench ttft: kvpush 1P1D, engines with {list(vllm_args) or 'defaults'}")
    stack.start()
    try:
        targets = {"proxy": stack.url, "prefill": specs[0].url, "decode": specs[1].url}
        for name, url in targets.items():
            asyncio.run(_sequential(url, warm, output_tokens))  # one-time compilation
            result[name] = _summary(asyncio.run(_sequential(url, prompts, output_tokens)))
            if name == "proxy":
                timelines = asyncio.run(_timelines(url))[-num_requests:]
                phases = {k for t in timelines for k in t["phases_s"]}
                result["proxy_phases_median_ms"] = {
                    k: float(np.median([t["phases_s"][k] * 1e3 for t in timelines]))
                    for k in sorted(phases)
                }
            print(f"  {name}: {result[name]}", flush=True)
    finally:
        stack.stop()
    mono = EngineSpec(
        "mono", model, DECODE_PORT, connector=None, engine_id="mono", extra_args=tuple(vllm_args)
    )
    plain = Stack([mono], "mono", PROXY_PORT, log_dir, with_proxy=False)
    plain.start()
    try:
        asyncio.run(_sequential(plain.url, warm, output_tokens))
        result["mono"] = _summary(asyncio.run(_sequential(plain.url, prompts, output_tokens)))
        print(f"  mono: {result['mono']}", flush=True)
    finally:
        plain.stop()
    result |= {"hardware": hardware(), "created_unix_s": int(time.time())}
    tail = result["proxy_phases_median_ms"].get("push_tail")
    print(f"push tail median (prefill's answer -> first token, at the proxy): {tail:.1f} ms")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0
