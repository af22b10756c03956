"""`kvpush plan`: whether this load should be disaggregated, and into how many prefill and
decode engines, from what a running proxy measured.

It reads the proxy's `/status` (the engines, their roles and health) and `/timelines` (each
recent request's path, prompt tokens, TTFT and TPOT) and answers in two steps:

1. **Disaggregate or not.** Where the proxy served both ways (`--disaggregation auto`, the
   default), the requests it pushed are set against those it served whole on one engine
   (`local`, `whole`): the share of each within the SLO, then their medians. Whole requests
   doing as well or better mean plain replicas win at this load: the advice is
   `--disaggregation never`. Only one kind measured: no verdict, and the advice to run `auto`.
   The two groups were not sent under the same conditions (the proxy computes a prompt on
   decode when prefill is queued), so this is a measured hint, not a controlled experiment.
2. **The split.** The engines' work per second, from the offered rate and the cheapest
   requests seen (the fastest TTFT per prompt token, the fastest TPOT: a request that queued
   behind none): prefill engine-seconds per second for the prompts, decode engine-seconds per
   second for the streams (an upper bound: a batch decodes many streams per step). The
   engines are divided in proportion, at least one each, and more engines are asked for when
   either side would stay busier than `BUSY` of its time.

Nothing is applied: the answer names the `kvpush up` flags that would.
"""

from __future__ import annotations

import json
import math
import statistics
import urllib.request
from dataclasses import asdict, dataclass, field

from kvpush.bench.slo import SloConfig

MIN_REQUESTS = 8  # per group, for a verdict
BUSY = 0.7  # past this share of its time busy, an engine's queue grows fast (M/M/1: 3x)
TIE = 0.05  # medians within 5 % are a tie


@dataclass(frozen=True)
class Group:
    """Requests served one way: how many, their medians, and the share within the SLO."""

    requests: int
    ttft_ms: float
    tpot_ms: float
    within_slo: float

    def text(self) -> str:
        return (
            f"{self.requests} requests, TTFT {self.ttft_ms:.0f} ms, TPOT {self.tpot_ms:.1f} ms, "
            f"{self.within_slo:.0%} within the SLO"
        )


@dataclass
class Plan:
    verdict: str  # "disaggregate", "replicas" or "unknown" (one way measured, or too few)
    prefill: int  # engines advised (today's where there is no reason to change)
    decode: int
    reasons: list[str] = field(default_factory=list)
    flags: str = ""  # what `kvpush up` would be given
    pushed: Group | None = None
    whole: Group | None = None
    rate_rps: float = 0.0
    prefill_busy: float = 0.0  # engine-seconds of work per second, over today's engines
    decode_busy: float = 0.0

    def text(self) -> str:
        split = f"{self.prefill} prefill + {self.decode} decode"
        head = {
            "disaggregate": f"disaggregate: {split}",
            "replicas": f"do not disaggregate: {self.prefill + self.decode} plain replicas",
            "unknown": f"no verdict; if disaggregated: {split}",
        }[self.verdict]
        lines = [f"kvpush plan: {head}"]
        lines += [f"  - {r}" for r in self.reasons]
        if self.flags:
            lines.append(f"  to apply: kvpush up {self.flags}")
        return "\n".join(lines)


def fetch(url: str, timeout_s: float = 10) -> tuple[dict, list[dict]]:
    """The proxy's /status and /timelines."""
    got = []
    for path in ("/status", "/timelines"):
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout_s) as r:
            got.append(json.loads(r.read()))
    return got[0], got[1]["timelines"]


def _group(rows: list[dict], slo: SloConfig) -> Group | None:
    if not rows:
        return None
    ttfts = [r["phases_s"]["ttft"] * 1e3 for r in rows]
    tpots = [(r["tpot_s"] or 0.0) * 1e3 for r in rows]
    good = sum(t <= slo.ttft_ms and p <= slo.tpot_ms for t, p in zip(ttfts, tpots, strict=True))
    return Group(len(rows), statistics.median(ttfts), statistics.median(tpots), good / len(rows))


def _low(values: list[float]) -> float:
    """The 10th percentile (the minimum of fewer than ten): a request that queued behind none."""
    values = sorted(values)
    return values[len(values) // 10]


def measured(timelines: list[dict], last: int | None = None) -> list[dict]:
    """The streamed requests that ended well, the newest `last` of them."""
    rows = [
        t
        for t in timelines
        if t.get("status") == "ok" and t.get("streamed") and "ttft" in t.get("phases_s", {})
    ]
    return rows[-last:] if last else rows


def plan(status: dict, timelines: list[dict], slo: SloConfig, last: int | None = None) -> Plan:
    engines = [e for e in status["engines"] if e["healthy"]]
    n_p = sum(e["role"] == "prefill" for e in engines)
    n_d = sum(e["role"] == "decode" for e in engines)
    rows = measured(timelines, last)
    result = Plan("unknown", n_p, n_d)
    if len(rows) < 2:
        result.reasons.append(
            f"{len(rows)} streamed requests measured: send load through the proxy first"
        )
        return result
    pushed = [r for r in rows if r.get("path") == "push"]
    whole = [r for r in rows if r.get("path") in ("local", "whole")]
    result.pushed, result.whole = _group(pushed, slo), _group(whole, slo)
    _verdict(result, slo)
    _split(result, rows, pushed, n_p, n_d)
    return result


def _verdict(result: Plan, slo: SloConfig) -> None:
    pushed, whole = result.pushed, result.whole
    if pushed is None or whole is None or min(pushed.requests, whole.requests) < MIN_REQUESTS:
        counts = (
            f"pushed {pushed.requests if pushed else 0}, whole {whole.requests if whole else 0}"
        )
        result.reasons.append(
            f"too few requests of one kind to compare ({counts}; {MIN_REQUESTS} each needed): "
            "run the proxy with --disaggregation auto (the default) under this load"
        )
        return
    faster_ttft = pushed.ttft_ms < whole.ttft_ms * (1 - TIE)
    faster_tpot = pushed.tpot_ms < whole.tpot_ms * (1 - TIE)
    slower = pushed.ttft_ms > whole.ttft_ms * (1 + TIE) or pushed.tpot_ms > whole.tpot_ms * (
        1 + TIE
    )
    if pushed.within_slo > whole.within_slo or (
        pushed.within_slo == whole.within_slo and (faster_ttft or faster_tpot) and not slower
    ):
        result.verdict = "disaggregate"
        result.reasons.append(
            f"pushed requests do better: {pushed.text()}; served whole: {whole.text()} "
            f"({slo.label()})"
        )
    else:
        result.verdict = "replicas"
        result.reasons.append(
            f"disaggregation does not pay at this load: served whole on one engine, "
            f"{whole.text()}; pushed, {pushed.text()} ({slo.label()})"
        )
        result.flags = "--disaggregation never"


def _split(result: Plan, rows: list[dict], pushed: list[dict], n_p: int, n_d: int) -> None:
    """Prefill and decode work per second, and the engines in proportion."""
    arrivals = sorted(r["arrival_monotonic_s"] for r in rows)
    span = arrivals[-1] - arrivals[0]
    if span <= 0:
        return
    rate = result.rate_rps = (len(rows) - 1) / span
    tokens = [r["prompt_tokens"] for r in rows if r.get("prompt_tokens")]
    if not tokens or not n_p or not n_d:
        return
    s_per_token = _low([r["phases_s"]["ttft"] / r["prompt_tokens"] for r in rows
                        if r.get("prompt_tokens")])  # fmt: skip
    prefill_work = rate * statistics.median(tokens) * s_per_token  # engine-seconds per second
    tpots = [r["tpot_s"] for r in rows if r.get("tpot_s")]
    chunks = [r["chunks"] for r in rows if r.get("chunks")]
    decode_work = rate * (statistics.median(chunks) - 1) * _low(tpots) if tpots and chunks else 0.0
    result.prefill_busy, result.decode_busy = prefill_work / n_p, decode_work / n_d
    result.reasons.append(
        f"offered {rate:.2f} requests/s: prefill work {prefill_work:.2f} engine-seconds a second "
        f"({result.prefill_busy:.0%} of {n_p} prefill engine(s)), decode at most "
        f"{decode_work:.2f} ({result.decode_busy:.0%} of {n_d} decode engine(s); batching "
        "makes it less)"
    )
    work = prefill_work + decode_work
    total = n_p + n_d
    needed = math.ceil(work / BUSY)
    if needed > total:
        result.reasons.append(
            f"{total} engines would be busy {work / total:.0%} of their time; {needed} keep "
            f"each under {BUSY:.0%}"
        )
        total = needed
    if result.verdict == "replicas":  # roles aside: every engine serves whole requests
        p = n_p
    else:
        p = min(max(round(total * prefill_work / work), 1), total - 1) if work > 0 else n_p
        if p != n_p:
            result.reasons.append(
                f"the engines in proportion to the work: {p} prefill, {total - p} decode"
            )
    if (p, total - p) != (n_p, n_d):
        result.prefill, result.decode = p, total - p
        result.flags = f"{result.flags} --prefill {p} --decode {total - p}".strip()


def as_json(result: Plan) -> str:
    return json.dumps(asdict(result), indent=2)
