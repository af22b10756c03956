"""Goodput: the share of requests that meet both a TTFT and a TPOT target (DistServe's measure,
vLLM's `bench serve --goodput`), computed from any `vllm bench serve` JSON saved with
`--save-detailed`, so results from elsewhere plot too. TPOT per request as vLLM defines it:
(latency - TTFT) / (output tokens - 1), 0 for a one-token answer; a failed request misses.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SHARE = 0.9  # the summary's "highest QPS" is the highest at which this share meets both


@dataclass(frozen=True)
class SloConfig:
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO targets must be > 0 ms, got {self}")

    @property
    def goodput(self) -> tuple[tuple[str, float], ...]:
        """As `vllm bench serve --goodput` takes them."""
        return (("ttft", self.ttft_ms), ("tpot", self.tpot_ms))

    def label(self) -> str:
        return f"TTFT <= {self.ttft_ms:g} ms and TPOT <= {self.tpot_ms:g} ms"


def of(result: dict) -> SloConfig | None:
    """The targets a kvpush result was run with, if any."""
    slo = result.get("slo")
    return SloConfig(slo["ttft_ms"], slo["tpot_ms"]) if slo else None


def attainment(result: dict, slo: SloConfig) -> float | None:
    """The share of the run's requests that met both targets; None without per-request data."""
    fields = ("ttfts", "latencies", "output_lens")
    if not all(isinstance(result.get(f), list) for f in fields):
        return None
    ttfts, latencies, output_lens = (result[f] for f in fields)
    errors = result.get("errors") or [""] * len(ttfts)
    if not ttfts:
        return None
    good = 0
    for ttft_s, latency_s, n_out, error in zip(ttfts, latencies, output_lens, errors, strict=True):
        if error or not n_out:
            continue
        tpot_s = (latency_s - ttft_s) / (n_out - 1) if n_out > 1 else 0.0
        good += ttft_s * 1e3 <= slo.ttft_ms and tpot_s * 1e3 <= slo.tpot_ms
    return good / len(ttfts)
