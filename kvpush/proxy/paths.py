"""Conditional disaggregation: for each request, the path its prompt takes.

- `push`: a prefill engine computes the prompt and pushes its KV to the decode engine (the
  disaggregated path);
- `local`: the decode engine computes the prompt itself, as one plain engine would.

Disaggregation pays only where prefill's interference with decode costs more than the split
itself: a prefill engine has a share of the hardware, and a long queue on it costs more than
computing the prompt where it will be decoded. The choice compares each path's expected time
to the first token, from what the proxy measures on every request: the prompt tokens queued
on each engine ahead of this one, and each engine's seconds per queued prompt token (an
average over its recent requests, queueing and interference included). `disaggregation` in
the proxy's settings: "auto" (this choice), "always" (every prompt pushed, kvpush's behaviour
before), "never" (every request whole on a decode engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.proxy.config import EngineState, ProxyConfig

DISAGGREGATION = ("auto", "always", "never")
PATHS = ("push", "local")
_WEIGHT = 0.2  # of each new observation in the average: the last ten or so requests count


@dataclass
class PrefillRate:
    """Seconds per prompt token an engine takes to answer a prompt's first token, queue
    included: each observation is the seconds from sending the request to its first token,
    over the prompt tokens that were queued on the engine ahead of it plus its own."""

    s_per_token: float | None = None
    samples: int = 0

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        prev = self.s_per_token
        self.s_per_token = rate if prev is None else prev + _WEIGHT * (rate - prev)
        self.samples += 1


@dataclass(frozen=True)
class Choice:
    path: str
    push_s: float | None = None  # the expected time to the first token on each path
    local_s: float | None = None


def choose(
    mode: str,
    tokens: int,
    prefill_queued: int,
    prefill_rate: PrefillRate,
    decode_queued: int,
    decode_rate: PrefillRate,
    margin: float,
) -> Choice:
    """The path of a prompt of `tokens`, given the prompt tokens queued on the prefill and
    the decode engine picked for it and their rates. With nothing measured on prefill yet the
    prompt is pushed; with nothing measured on decode its rate is taken as prefill's (the
    same hardware). `local` must be expected faster by `margin` (a fraction): decode's own
    prefills slow its decodes, which the first token's time does not show."""
    if mode == "always" or (mode == "auto" and prefill_rate.s_per_token is None):
        return Choice("push")
    if mode == "never":
        return Choice("local")
    s_p = prefill_rate.s_per_token
    assert s_p is not None
    s_d = decode_rate.s_per_token if decode_rate.s_per_token is not None else s_p
    push_s = (prefill_queued + tokens) * s_p
    local_s = (decode_queued + tokens) * s_d
    path = "local" if local_s < push_s * (1 - margin) else "push"
    return Choice(path, push_s, local_s)


def pick(config: ProxyConfig, prefill: EngineState, decode: EngineState, tokens: int) -> Choice:
    """`choose` for a prompt between two engines of the pool: prefill's queue is its
    outstanding prefill legs, decode's the prompts it computes itself. Only kvpush chooses;
    vLLM's own connectors always push."""
    mode = config.disaggregation if config.connector == "kvpush" else "always"
    return choose(
        mode,
        tokens,
        prefill.outstanding_tokens,
        prefill.rate,
        decode.local_tokens,
        decode.rate,
        config.local_margin,
    )
