"""`kvpush plan` (kvpush.bench.plan): the verdict and the split from a proxy's /status and
/timelines. Here on made-up timelines, each rule alone; tests/e2e/test_paths.py runs it against
a proxy in front of real engines."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpush.bench.plan import MIN_REQUESTS, plan
from kvpush.bench.slo import SloConfig

SLO = SloConfig(500, 8)


def status(prefill: int = 1, decode: int = 1) -> dict:
    roles = ["prefill"] * prefill + ["decode"] * decode
    return {"engines": [{"role": r, "healthy": True} for r in roles]}


def row(path: str, at: float, ttft_s: float, tpot_s: float, tokens: int = 2000) -> dict:
    return {
        "status": "ok",
        "streamed": True,
        "path": path,
        "prompt_tokens": tokens,
        "chunks": 32,
        "tpot_s": tpot_s,
        "phases_s": {"ttft": ttft_s},
        "arrival_monotonic_s": at,
    }


def timelines(pushed: tuple[float, float], whole: tuple[float, float], n: int = 10) -> list:
    """n requests each way, interleaved, one every 0.5 s."""
    out = []
    for i in range(n):
        out.append(row("push", i, *pushed))
        out.append(row("local" if i % 2 else "whole", i + 0.5, *whole))
    return out


def test_whole_requests_doing_as_well_mean_plain_replicas():
    p = plan(status(), timelines(pushed=(0.30, 0.009), whole=(0.25, 0.005)), SLO)
    assert p.verdict == "replicas" and p.flags == "--disaggregation never"
    assert (p.prefill, p.decode) == (1, 1)
    assert "does not pay" in p.reasons[0] and "TPOT 9.0 ms" in p.reasons[0]
    assert p.pushed is not None and p.pushed.within_slo == 0
    assert p.whole is not None and p.whole.within_slo == 1


def test_pushed_requests_doing_better_mean_disaggregate():
    p = plan(status(), timelines(pushed=(0.25, 0.005), whole=(0.30, 0.009)), SLO)
    assert p.verdict == "disaggregate" and p.flags == ""
    assert p.rate_rps == pytest.approx(2.0, rel=0.01)
    # 2 requests/s x 2000 tokens x 125 us a token (the cheapest TTFT per token): 0.5 s a second
    assert p.prefill_busy == pytest.approx(0.5, rel=0.01)


def test_the_engines_follow_the_work():
    """Prompts heavy, decodes light, on one prefill and two decode engines: two prefill."""
    rows = timelines(pushed=(0.3, 0.002), whole=(0.4, 0.004))
    p = plan(status(prefill=1, decode=2), rows, SLO)
    assert p.verdict == "disaggregate"
    assert (p.prefill, p.decode) == (2, 1) and p.flags == "--prefill 2 --decode 1"


@pytest.mark.parametrize("pushed_tpot_s", [0.004, 0.003])
def test_more_engines_when_they_would_stay_busy(pushed_tpot_s):
    """Ten requests a second of 0.3 s prompts: three engines' worth of prefill alone, whether
    disaggregated (pushed faster) or as replicas (a tie)."""
    rows = [
        row("push", i * 0.1, 0.3, pushed_tpot_s) if i % 2 else row("local", i * 0.1, 0.3, 0.004)
        for i in range(40)
    ]
    p = plan(status(), rows, SLO)
    assert p.prefill + p.decode >= 5, p.reasons
    assert any("keep each under" in r for r in p.reasons)
    if p.verdict == "replicas":
        assert p.flags.startswith("--disaggregation never --prefill 1 --decode")
    else:
        assert p.verdict == "disaggregate" and p.prefill > p.decode


def test_one_way_measured_gives_no_verdict_and_says_what_to_run():
    rows = [row("push", i, 0.25, 0.005) for i in range(20)]
    p = plan(status(), rows, SLO)
    assert p.verdict == "unknown" and f"{MIN_REQUESTS} each" in p.reasons[0]
    assert "--disaggregation auto" in p.reasons[0]


def test_nothing_measured_says_so():
    p = plan(status(), [], SLO)
    assert p.verdict == "unknown" and "send load" in p.reasons[0]


def test_only_the_newest_requests_count_with_last():
    old = timelines(pushed=(0.25, 0.005), whole=(0.30, 0.009))
    new = [dict(r, arrival_monotonic_s=r["arrival_monotonic_s"] + 100)
           for r in timelines(pushed=(0.30, 0.009), whole=(0.25, 0.005))]  # fmt: skip
    assert plan(status(), old + new, SLO, last=20).verdict == "replicas"
    assert plan(status(), old, SLO, last=20).verdict == "disaggregate"


def test_the_command_refuses_bad_input_and_an_unreachable_proxy():
    cmd = [sys.executable, "-m", "kvpush.cli", "plan"]
    bad = subprocess.run(cmd + ["--last", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--last" in bad.stderr
    gone = subprocess.run(cmd + ["--url", "http://127.0.0.1:9"], capture_output=True, text=True)
    assert gone.returncode == 1 and "cannot read the proxy" in gone.stderr
