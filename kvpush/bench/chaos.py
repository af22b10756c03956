"""`kvpush bench chaos`: Poisson load on a local kvpush stack (2P2D by default) while its
engines are SIGKILLed and restarted at random, then what every request got.

Every request is a streamed greedy completion of a fresh prompt (random token ids) with
`ignore_eos`, so its whole answer is known in length, and each client's stream is checked as
it comes: HTTP 200, one `id`, no error event, `[DONE]` last, usage counting every token asked
for. A request refused at admission (503 with Retry-After, kvpush.proxy.pool) is counted
apart from one that failed. The load is a few lines of asyncio rather than `vllm bench
serve`, which checks none of that per request. Afterwards, every request the proxy migrated
(its timeline names the client's X-Request-Id) and a sample of the others are sent again, one
at a time, to an engine serving them plain, and their token ids compared.

The kills: every `kill_every_s` on average (exponential), one engine that is up, of a role
with another engine up (a stack always has one prefill and one decode serving), is SIGKILLed
and started again at once on its own ports; the proxy finds it healthy again by its checks.
The result JSON: requests sent, completed, migrated, re-sent, refused, failed (with the first
few reasons), the kills, leases expired, and each engine's KV blocks in use and kvpush gauges
once idle (all must be 0).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvpush import httpclient
from kvpush.launch.engine import Engine
from kvpush.launch.stack import Stack

NUM_CHECKED_PLAIN = 50  # requests not migrated whose answers are checked against a plain one
NOT_HELD = ("leases_expired", "preemptions")  # counts, in an engine's state at the end


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 600.0
    qps: float = 2.0
    num_prefill: int = 2
    num_decode: int = 2
    kill_every_s: float = 45.0  # mean seconds between kills; 0: no kills (an overload run)
    min_input_len: int = 64
    max_input_len: int = 1024
    max_tokens: int = 256  # a second or two of decoding here: streams are mid-answer at a kill
    request_timeout_s: float = 120.0  # a request not answered by then counts as failed
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.qps <= 0:
            raise ValueError(f"duration_s and qps must be > 0, got {self.duration_s}, {self.qps}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("the stack needs at least one prefill and one decode engine")
        if self.kill_every_s < 0:
            raise ValueError(f"kill_every_s must be >= 0, got {self.kill_every_s}")
        if not 1 <= self.min_input_len <= self.max_input_len:
            raise ValueError("need 1 <= min_input_len <= max_input_len")


@dataclass
class Outcome:
    request_id: str
    prompt: list[int]
    max_tokens: int
    status: str = ""  # "ok", "refused" (503 at admission), or what failed
    seconds: float = 0.0  # from sending it to its end
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Kill:
    at_s: float
    engine: str
    ready_after_s: float | None = None


async def one_request(c: aiohttp.ClientSession, url: str, out: Outcome, timeout_s: float) -> None:
    """One streamed request, its stream checked as it comes (see the module's doc)."""
    body = {
        "model": "tiny", "prompt": out.prompt, "max_tokens": out.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    headers = {"X-Request-Id": out.request_id}
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with c.post(url + "/v1/completions", json=body, headers=headers) as r:
                if r.status == 503 and "Retry-After" in r.headers:
                    out.status = "refused"
                    return
                if r.status != 200:
                    out.status = f"HTTP {r.status}: {(await r.text())[:200]}"
                    return
                out.status = check_stream(await read_events(r), out)
    except TimeoutError:
        out.status = f"no answer in {timeout_s:g} s"
    except aiohttp.ClientError as e:
        out.status = f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.monotonic() - start


async def read_events(r: aiohttp.ClientResponse) -> list[Any]:
    """The stream's events as JSON, and "[DONE]" where it came (check_stream needs it)."""
    return [
        "[DONE]" if data == b"[DONE]" else json.loads(data) async for data in httpclient.sse_data(r)
    ]


def check_stream(events: list[Any], out: Outcome) -> str:
    """ "ok", or what is wrong with this stream; `out.token_ids` gets its tokens."""
    if not events or events[-1] != "[DONE]":
        return "no [DONE] at the end"
    errors = [e["error"] for e in events[:-1] if "error" in e]
    if errors:
        return f"error event: {str(errors[0].get('message'))[:200]}"
    if len({e["id"] for e in events[:-1]}) != 1:
        return "more than one id"
    choices = [c for e in events[:-1] for c in e["choices"]]
    out.token_ids = [t for c in choices for t in c.get("token_ids") or ()]
    usage = events[-2].get("usage") or {}
    if len(out.token_ids) != out.max_tokens or usage.get("completion_tokens") != out.max_tokens:
        return f"{len(out.token_ids)} tokens, usage {usage}, of {out.max_tokens} asked"
    return "ok"


class Chaos:
    def __init__(self, config: ChaosConfig, stack: Stack) -> None:
        self.config, self.stack = config, stack
        self.rng = random.Random(config.seed)
        self.outcomes: list[Outcome] = []
        self.kills: list[Kill] = []
        self.leases_expired = 0.0  # from each engine's metrics, read before it is killed
        self.start = time.monotonic()
        self._restarting: set[int] = set()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    async def load(self, url: str) -> None:
        """Poisson arrivals for duration_s; returns when every request has ended."""
        cfg, tasks = self.config, []
        async with httpclient.session(4096, None) as c:
            while self.elapsed() < cfg.duration_s:
                n = self.rng.randint(cfg.min_input_len, cfg.max_input_len)
                prompt = [self.rng.randrange(3, 4096) for _ in range(n)]
                out = Outcome(f"chaos-{len(self.outcomes)}", prompt, cfg.max_tokens)
                self.outcomes.append(out)
                tasks.append(asyncio.ensure_future(one_request(c, url, out, cfg.request_timeout_s)))
                await asyncio.sleep(self.rng.expovariate(cfg.qps))
            await asyncio.gather(*tasks)

    async def kill_at_random(self) -> None:
        cfg = self.config
        if cfg.kill_every_s == 0:
            return
        while True:
            await asyncio.sleep(self.rng.expovariate(1 / cfg.kill_every_s))
            if self.elapsed() >= cfg.duration_s:
                return
            victims = [i for i in range(len(self.stack.engines)) if self._killable(i)]
            if victims:
                await self._kill(self.rng.choice(victims))

    def _killable(self, i: int) -> bool:
        engines, role = self.stack.engines, self.stack.engines[i].spec.role
        up = [j for j, e in enumerate(engines) if j not in self._restarting and e.spec.role == role]
        return i in up and len(up) > 1

    async def _kill(self, i: int) -> None:
        engine = self.stack.engines[i]
        self.leases_expired += await asyncio.to_thread(leases_expired, engine.spec.url)
        kill = Kill(round(self.elapsed(), 1), engine.spec.name)
        self.kills.append(kill)
        self._restarting.add(i)
        await asyncio.to_thread(engine.kill)
        print(f"  {kill.at_s:6.1f} s  killed {engine.spec.name}; starting it again", flush=True)
        replacement = Engine(engine.spec, engine.log_path)
        self.stack.engines[i] = replacement
        await asyncio.to_thread(replacement.wait_ready)
        kill.ready_after_s = round(self.elapsed() - kill.at_s, 1)
        self._restarting.discard(i)

    async def report_progress(self) -> None:
        while True:
            await asyncio.sleep(15)
            counts: dict[str, int] = {}
            for o in self.outcomes:
                key = o.status if o.status in ("", "ok", "refused") else "failed"
                counts[key or "in flight"] = counts.get(key or "in flight", 0) + 1
            print(f"  {self.elapsed():6.1f} s  sent {len(self.outcomes)}  {counts}  "
                  f"kills {len(self.kills)}", flush=True)  # fmt: skip


def leases_expired(url: str) -> float:
    """kvpush:failures{cause="lease"} on one engine (0 where it cannot be read)."""
    try:
        samples = metric_samples(url)
    except OSError:
        return 0.0
    return sum(v for k, v in samples.items() if k.startswith("kvpush:failures_total{") and
               'cause="lease"' in k)  # fmt: skip


def metric_samples(url: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def moved_requests(proxy_url: str) -> set[str]:
    """The client ids of the requests the proxy migrated or re-sent (its /timelines)."""
    import urllib.request

    with urllib.request.urlopen(proxy_url + "/timelines", timeout=30) as r:
        timelines = json.loads(r.read())["timelines"]
    return {t["client_id"] for t in timelines if t.get("migrations") and t.get("client_id")}


async def check_plain(chaos: Chaos, migrated: set[str]) -> dict[str, Any]:
    """The migrated requests and a sample of the others, again, one at a time, plain on a
    decode engine (no kv_transfer_params: computed there whole): token ids compared."""
    done = [o for o in chaos.outcomes if o.status == "ok"]
    moved = [o for o in done if o.request_id in migrated]
    others = [o for o in done if o.request_id not in migrated]
    sample = moved + chaos.rng.sample(others, min(NUM_CHECKED_PLAIN, len(others)))
    url = next(e.spec.url for e in chaos.stack.engines if e.spec.role == "decode")
    mismatched = []
    async with httpclient.session(4, None) as c:
        for o in sample:
            body = {"model": "tiny", "prompt": o.prompt, "max_tokens": o.max_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            async with c.post(url + "/v1/completions", json=body) as r:
                want = (await r.json())["choices"][0]["token_ids"]
            if want != o.token_ids:
                mismatched.append(o.request_id)
    return {"checked": len(sample), "migrated_checked": len(moved), "mismatched": mismatched}


def engine_at_end(url: str, timeout_s: float = 60) -> dict[str, Any]:
    """An engine once idle: its KV cache usage and kvpush's gauges, polled until all are 0
    or `timeout_s` passes (what is left then is held)."""
    from kvpush.vllm.stats import GAUGES

    deadline = time.monotonic() + timeout_s
    while True:
        samples = metric_samples(url)
        held = {f"kvpush:{g}": samples.get(f"kvpush:{g}", 0.0) for g in GAUGES}
        state = {"kv_cache_usage_perc": samples.get("vllm:kv_cache_usage_perc", 0.0)} | held
        if not any(state.values()) or time.monotonic() > deadline:
            preempted = samples.get("vllm:num_preemptions_total", 0.0)
            return state | {"leases_expired": leases_expired(url), "preemptions": preempted}
        time.sleep(0.5)


def percentiles(values: list[float]) -> list[float]:
    """The median and the 99th percentile, rounded to 10 ms; [] for no values."""
    if not values:
        return []
    ordered = sorted(values)
    return [round(ordered[int(q * (len(ordered) - 1))], 2) for q in (0.5, 0.99)]


def summary(chaos: Chaos, proxy: dict[str, float], engines: dict[str, dict]) -> dict[str, Any]:
    failed = [o for o in chaos.outcomes if o.status not in ("ok", "refused")]
    done = [o for o in chaos.outcomes if o.status == "ok"]
    reasons: dict[str, int] = {}
    for o in failed:
        reasons[o.status] = reasons.get(o.status, 0) + 1

    def labelled(name: str) -> dict[str, float]:
        return {k: v for k, v in proxy.items() if k.startswith(name + "{")}

    def total(name: str) -> float:
        return sum(labelled(name).values())

    return {
        "config": asdict(chaos.config),
        "requests_sent": len(chaos.outcomes),
        "completed_ok": sum(o.status == "ok" for o in chaos.outcomes),
        "refused_503": sum(o.status == "refused" for o in chaos.outcomes),
        "failed": len(failed),
        "seconds_to_end_p50_p99": percentiles([o.seconds for o in done]),
        "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:10]),
        "migrated": total("kvpush_proxy_migrated_total"),
        "migrated_by_cause": labelled("kvpush_proxy_migrated_total"),
        "streams_failed": total("kvpush_proxy_streams_failed_total"),
        "rerouted": labelled("kvpush_proxy_rerouted_total"),
        "kills": [asdict(k) for k in chaos.kills],
        "leases_expired": chaos.leases_expired,
        "engines_at_end": engines,
    }  # fmt: skip


async def soak(chaos: Chaos, url: str) -> None:
    progress = asyncio.ensure_future(chaos.report_progress())
    killer = asyncio.ensure_future(chaos.kill_at_random())
    try:
        await chaos.load(url)
        await killer  # a restart still under way is waited for
    finally:
        progress.cancel()
        killer.cancel()


def run(config: ChaosConfig, results_dir: Path, model: str, disaggregation: str) -> Path:
    """Bring the stack up, soak it, write the result JSON; its path."""
    from kvpush.launch.stack import PROXY_PORT, stack_specs

    results_dir.mkdir(parents=True, exist_ok=True)
    specs = stack_specs(model, "kvpush", config.num_prefill, config.num_decode)
    stack = Stack(specs, "kvpush", PROXY_PORT, results_dir / "logs",
                  disaggregation=disaggregation)  # fmt: skip
    print(f"kvpush bench chaos: {config.num_prefill}P{config.num_decode}D, "
          f"--disaggregation {disaggregation}", flush=True)  # fmt: skip
    stack.start()
    try:
        chaos = Chaos(config, stack)
        print(f"  {config.duration_s:g} s of load at {config.qps:g} QPS; a kill every "
              f"{config.kill_every_s:g} s on average", flush=True)  # fmt: skip
        asyncio.run(soak(chaos, stack.url))
        print("  load done; waiting for the engines to go idle", flush=True)
        engines = {e.spec.name: engine_at_end(e.spec.url) for e in stack.engines}
        chaos.leases_expired += sum(e["leases_expired"] for e in engines.values())
        proxy = metric_samples(stack.url)
        migrated = moved_requests(stack.url)
        result = summary(chaos, proxy, engines)
        print(f"  checking {len(migrated)} migrated and {NUM_CHECKED_PLAIN} other answers "
              "against plain ones", flush=True)  # fmt: skip
        result["checked_against_plain"] = asyncio.run(check_plain(chaos, migrated))
    finally:
        stack.stop()
    path = results_dir / "chaos.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def main(args: Any) -> int:
    from kvpush.launch import tinymodel

    config = ChaosConfig(
        duration_s=args.duration_s, qps=args.qps, num_prefill=args.prefill,
        num_decode=args.decode, kill_every_s=args.kill_every_s, max_tokens=args.max_tokens,
        min_input_len=args.min_input_len, max_input_len=args.max_input_len,
        request_timeout_s=args.request_timeout_s,
        seed=args.seed if args.seed is not None else random.randrange(2**31),
    )  # fmt: skip
    results_dir = Path(args.results_dir)
    if (results_dir / "chaos.json").exists():
        raise SystemExit(f"{results_dir} holds a chaos result already: name another folder")
    model = args.model or str(tinymodel.ensure())
    path = run(config, results_dir, model, args.disaggregation)
    result = json.loads(path.read_text())
    keys = ("requests_sent", "completed_ok", "refused_503", "failed", "migrated",
            "streams_failed", "leases_expired")  # fmt: skip
    print("  " + ", ".join(f"{k} {result[k]:g}" for k in keys))
    print(f"  answers checked against plain ones: {result['checked_against_plain']}")
    for name, state in result["engines_at_end"].items():
        held = {k: v for k, v in state.items() if v and k not in NOT_HELD}
        print(f"  {name} at the end: {held or 'no KV block in use, every kvpush gauge 0'}")
    print(f"wrote {path}")
    ok = result["failed"] == 0 and not result["checked_against_plain"]["mismatched"]
    return 0 if ok else 1
