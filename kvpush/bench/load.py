"""Load generator: Poisson arrivals of streaming completions with exact-length prompts.

Per request it records TTFT (first streamed token), ITL (gaps between streamed events), TPOT
((E2EL - TTFT) / (output tokens - 1)) and E2EL, and summarises them with the field names
`vllm bench serve` writes.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from kvpush import httpclient

RESERVED_IDS = 3  # the tiny model's special tokens are ids 0..2


@dataclass
class RequestResult:
    ok: bool
    ttft_ms: float = 0.0
    e2el_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)


def random_prompt(num_tokens: int, rng: random.Random, vocab: int = 4096) -> list[int]:
    """Distinct random token ids: no two requests share a prefix, so no cache helps."""
    return [rng.randrange(RESERVED_IDS, vocab) for _ in range(num_tokens)]


async def one_request(
    client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    times: list[float] = []
    counted = 0  # completion_tokens from the final usage event
    try:
        async with client.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {r.status}: {text[:200]}")
            async for event in httpclient.sse_events(r):
                if "error" in event:
                    return RequestResult(False, error=str(event["error"])[:200])
                if event.get("choices") and event["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
                if event.get("usage"):
                    counted = event["usage"].get("completion_tokens") or 0
    except (aiohttp.ClientError, TimeoutError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    if not times:
        return RequestResult(False, error="no tokens streamed")
    ttft = (times[0] - start) * 1e3
    itl = [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
    # An engine that falls behind its client merges several tokens into one event, so the
    # token count comes from usage; ITLs stay per event, as `vllm bench serve` records them.
    return RequestResult(True, ttft, (times[-1] - start) * 1e3, itl, counted or len(times))


async def run_load(
    url: str,
    model: str,
    qps: float,
    input_len: int,
    output_len: int,
    num_prompts: int,
    seed: int,
    progress: str = "",
) -> dict:
    """Send `num_prompts` requests with exponential gaps (mean 1/qps); summarise."""
    rng = random.Random(seed)
    prompts = [random_prompt(input_len, rng) for _ in range(num_prompts)]
    gaps = [rng.expovariate(qps) for _ in range(num_prompts)]
    done = 0

    async def fire(i: int) -> RequestResult:
        nonlocal done
        result = await one_request(client, url, model, prompts[i], output_len)
        done += 1
        if progress:
            bar = "#" * (20 * done // num_prompts)
            print(
                f"\r  {progress} [{bar:<20}] {done}/{num_prompts}",
                end="",
                file=sys.stderr,
                flush=True,
            )
        return result

    async with httpclient.session(num_prompts + 8) as client:
        waiting: list[float] = []
        sampler = asyncio.create_task(sample_waiting(client, url, waiting))
        start = time.perf_counter()
        tasks = []
        for i in range(num_prompts):
            tasks.append(asyncio.create_task(fire(i)))
            await asyncio.sleep(gaps[i])
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        sampler.cancel()
    if progress:
        print(file=sys.stderr)
    summary = summarize(results, duration)
    summary["decode_waiting_on_prefill"] = (
        {"max": max(waiting), "mean": statistics.fmean(waiting), "samples": len(waiting)}
        if waiting
        else None
    )
    return summary


WAITING = re.compile(r"^kvpush_proxy_decode_waiting_on_prefill\{[^}]*\} (\S+)$", re.M)


async def sample_waiting(client: aiohttp.ClientSession, url: str, out: list[float]) -> None:
    """Every 0.25 s, the proxy's count of decode requests whose blocks wait for prefill
    (summed over decode engines). Nothing is recorded against a plain engine."""
    while True:
        text = None
        try:
            async with client.get(url + "/metrics", timeout=aiohttp.ClientTimeout(5)) as r:
                if r.status == 200:
                    text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            pass
        if text is not None:
            values = WAITING.findall(text)
            if not values:
                return  # not a kvpush proxy
            out.append(sum(float(v) for v in values))
        await asyncio.sleep(0.25)


def _stats(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std", "p99")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        f"mean_{name}_ms": statistics.fmean(values),
        f"median_{name}_ms": statistics.median(values),
        f"std_{name}_ms": statistics.pstdev(values),
        f"p99_{name}_ms": p99,
    }


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_ms for r in ok]
    tpots = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    itls = [x for r in ok for x in r.itl_ms]
    e2els = [r.e2el_ms for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:10],
        "duration": duration_s,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        summary |= _stats(name, values)
    summary |= {
        "ttfts": ttfts,
        "tpots": tpots,
        "itls": itls,
        "e2els": e2els,
        "output_lens": [r.output_tokens for r in ok],
    }
    return summary
