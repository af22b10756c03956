"""SLO attainment from `vllm bench serve`'s per-request fields."""

from __future__ import annotations

import pytest

from kvpush.bench.slo import SloConfig, attainment, of


def result(*requests):
    """(ttft_s, latency_s, output_len, error) per request, as vLLM's detailed JSON has them."""
    return {
        "ttfts": [r[0] for r in requests],
        "latencies": [r[1] for r in requests],
        "output_lens": [r[2] for r in requests],
        "errors": [r[3] for r in requests],
    }


def test_a_request_counts_only_when_it_meets_both_targets():
    slo = SloConfig(ttft_ms=100, tpot_ms=10)
    r = result(
        (0.05, 0.05 + 9 * 0.009, 10, ""),  # both met
        (0.15, 0.15 + 9 * 0.001, 10, ""),  # TTFT missed
        (0.05, 0.05 + 9 * 0.011, 10, ""),  # TPOT missed
        (0.09, 0.09, 1, ""),  # one token: TPOT 0, as vLLM counts it
        (0.0, 0.0, 0, "HTTP 500"),  # failed: a miss
    )
    assert attainment(r, slo) == pytest.approx(2 / 5)


def test_without_per_request_data_there_is_no_attainment():
    assert attainment({"median_ttft_ms": 5.0}, SloConfig(1, 1)) is None


def test_targets_are_checked_and_read_back_from_a_result():
    with pytest.raises(ValueError, match="> 0 ms"):
        SloConfig(0, 8)
    assert of({"slo": {"ttft_ms": 500.0, "tpot_ms": 8.0}}) == SloConfig(500, 8)
    assert of({}) is None
    assert SloConfig(500, 8).goodput == (("ttft", 500), ("tpot", 8))
