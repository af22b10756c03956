"""Conditional disaggregation: for each request, the path its prompt takes.

- `push`: a prefill engine computes the prompt and pushes its KV to the decode engine (the
  disaggregated path);
- `local`: the decode engine computes the prompt itself, as one plain engine would;
- `whole`: the prefill engine serves the whole request, prompt and decode, as one plain
  engine would: where the decode engine has more requests decoding than the prefill engine,
  the prefill engine takes a share of the decoding (replicas' balance).

Disaggregation pays only where prefill's interference with decode costs more than the split
itself: a prefill engine has a share of the hardware, and a long queue on it costs more than
computing the prompt where it will be decoded. The choice first compares where the prompt is
expected to give its first token sooner, from what the proxy measures on every request: the
prompt tokens queued on each engine ahead of this one, and each engine's seconds per queued
prompt token (an average over its recent requests, queueing and interference included). A
prompt computed on the prefill engine is then decoded where fewer requests are decoding.
`disaggregation` in the proxy's settings: "auto" (this choice), "always" (every prompt pushed,
kvpush's behaviour before), "never" (no prompt pushed: every engine, whatever its role, serves
whole requests as a plain replica, each request on the engine with the least queued, see
`plain_engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.proxy.config import EngineState, ProxyConfig

DISAGGREGATION = ("auto", "always", "never")
PATHS = ("push", "local", "whole")
DECODE_SLACK = 1  # `whole` once decode has more than this many more requests decoding
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
    prefill: Load,
    decode: Load,
    margin: float,
) -> Choice:
    """The path of a prompt of `tokens` between a prefill and a decode engine under `Load`.
    With nothing measured on prefill yet the prompt is pushed; with nothing measured on
    decode its rate is taken as prefill's (the same hardware). `local` must be expected
    faster by `margin` (a fraction): decode's own prefills slow its decodes, which the first
    token's time does not show."""
    if mode == "always" or (mode == "auto" and prefill.rate.s_per_token is None):
        return Choice("push")
    if mode == "never":  # the dispatcher asks `plain_engine` first; between two: decode's
        return Choice("local")
    s_p = prefill.rate.s_per_token
    assert s_p is not None
    s_d = decode.rate.s_per_token if decode.rate.s_per_token is not None else s_p
    push_s = (prefill.queued + tokens) * s_p
    local_s = (decode.queued + tokens) * s_d
    if local_s < push_s * (1 - margin):
        path = "local"
    elif prefill.decoding + DECODE_SLACK < decode.decoding:
        path = "whole"
    else:
        path = "push"
    return Choice(path, push_s, local_s)


@dataclass(frozen=True)
class Load:
    """What an engine has on hand, as the proxy counts it."""

    queued: int  # prompt tokens it has yet to answer the first token of
    decoding: int  # requests past their first token
    rate: PrefillRate


def pick(config: ProxyConfig, prefill: EngineState, decode: EngineState, tokens: int) -> Choice:
    """`choose` for a prompt between two engines of the pool. Only kvpush chooses; vLLM's own
    connectors always push."""
    mode = config.disaggregation if config.connector == "kvpush" else "always"
    # prefill's queue: its prefill legs (held until prefill answers) and its whole requests'
    # prompts; decode's: its whole requests' prompts
    p_load = Load(prefill.outstanding_tokens + prefill.local_tokens, prefill.decoding, prefill.rate)
    d_load = Load(decode.local_tokens, decode.decoding, decode.rate)
    return choose(mode, tokens, p_load, d_load, config.local_margin)


def plain_engine(engines: list[EngineState]) -> EngineState:
    """`never`: the engine, of either role, that serves the next request whole, as among plain
    replicas: the fewest prompt tokens queued, then the fewest streams decoding, then the
    fewest requests in flight; a decode engine first on a tie."""
    return min(
        engines,
        key=lambda s: (
            s.local_tokens + (s.outstanding_tokens if s.info.role == "prefill" else 0),
            s.decoding,
            s.outstanding,
            s.info.role != "decode",
        ),
    )
