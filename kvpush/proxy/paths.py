"""Conditional disaggregation: for each request, the path its prompt takes.

- `push`: a prefill engine computes the prompt and pushes its KV to the decode engine (the
  disaggregated path);
- `local`: a decode engine serves the whole request, prompt and decode, as one plain engine;
- `whole`: a prefill engine serves the whole request, as one plain engine.

Disaggregation pays only where prefill's interference with decode costs more than the split
itself: a prefill engine has a share of the hardware, and the decode engine carries every
pushed request's decoding. So the choice is made from what the proxy measures on every
request, in the two terms of a request's time to its last token:

- **to the first token**: the prompt tokens queued on an engine ahead of this one plus this
  prompt's own (less what the engine likely holds in its prefix cache: `prefix.py`), times
  that engine's measured seconds per queued prompt token (`PrefillRate`, a moving average over
  its recent requests, queueing and interference included);
- **per token after it**: the measured TPOT of recent pushed requests, and of recent requests
  served whole (`PathCosts`), each under whatever else shared their engine: decode's batch and
  the prompts it computed itself for pushed requests, the engine's other prompts for whole
  ones.

The plain candidate is the engine of either role a plain replica's front would pick
(`plain_engine`: least queued, then least decoding). `auto` takes the path expected to end the
request sooner (TTFT + (max_tokens - 1) x TPOT); every `EXPLORE_EVERY`-th request takes the
other, so that both measures stay current as the load moves. Until prefill is measured every
prompt is pushed; until each TPOT is, its path is taken. `always`: every prompt pushed (kvpush
before issue 44). `never`: no prompt pushed, every engine a plain replica.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.proxy.config import EngineState

DISAGGREGATION = ("auto", "always", "never")
PATHS = ("push", "local", "whole")
EXPLORE_EVERY = 8  # one request in this many takes the path not chosen
DEFAULT_MAX_TOKENS = 16  # vLLM's completions default, when the request names none
_WEIGHT = 0.2  # of each new observation in the averages: the last ten or so requests count


@dataclass
class Average:
    """A moving average: each new observation moves it `_WEIGHT` of the way."""

    value: float | None = None
    samples: int = 0

    def observe(self, x: float) -> None:
        prev = self.value
        self.value = x if prev is None else prev + _WEIGHT * (x - prev)
        self.samples += 1


@dataclass
class PrefillRate(Average):
    """Seconds per prompt token an engine takes to answer a prompt's first token, queue
    included: each observation is the seconds from sending the request to its first token,
    over the prompt tokens that were queued on the engine ahead of it plus its own."""

    @property
    def s_per_token(self) -> float | None:
        return self.value

    def observe_prompt(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds > 0:
            self.observe(seconds / tokens)


@dataclass
class PathCosts:
    """The measured TPOT of pushed requests and of requests served whole (seconds)."""

    push: Average = field(default_factory=Average)
    plain: Average = field(default_factory=Average)
    turn: int = 0  # requests chosen so far, for exploration

    def observe(self, path: str, tpot_s: float | None) -> None:
        if tpot_s is None or tpot_s <= 0 or path not in PATHS:
            return
        (self.push if path == "push" else self.plain).observe(tpot_s)


@dataclass(frozen=True)
class Choice:
    path: str
    engine: EngineState | None = None  # the engine serving it whole (`local`, `whole`)
    push_s: float | None = None  # the expected time to the last token on each path
    plain_s: float | None = None
    explored: bool = False  # taken to keep the other path's measure current


def queued_tokens(s: EngineState) -> int:
    """Prompt tokens an engine has yet to answer the first token of: a prefill engine's
    prefill legs (`outstanding_tokens`) and, on either role, the whole requests' prompts."""
    return s.local_tokens + (s.outstanding_tokens if s.info.role == "prefill" else 0)


def uncached(s: EngineState, tokens: int, hashes: tuple[int, ...]) -> int:
    """The prompt tokens an engine would compute: less its likely prefix-cache hit."""
    if s.prefix is None or not hashes:
        return tokens
    return max(1, tokens - s.prefix.match_tokens(hashes))


def plain_engine(
    engines: Iterable[EngineState], tokens: int, hashes: tuple[int, ...] = ()
) -> EngineState:
    """The engine, of either role, that serves the next request whole, as a plain replica's
    front would pick it: the fewest prompt tokens to compute before its first token (queued
    ones, plus its own less the engine's likely prefix-cache hit), then the fewest streams
    decoding, then the fewest requests in flight; a decode engine first on a tie."""
    return min(
        engines,
        key=lambda s: (
            queued_tokens(s) + uncached(s, tokens, hashes),
            s.decoding,
            s.outstanding,
            s.info.role != "decode",
        ),
    )


def first_token_s(s: EngineState, tokens: int, hashes: tuple[int, ...], rate: float) -> float:
    return (queued_tokens(s) + uncached(s, tokens, hashes)) * rate


def choose(
    mode: str,
    prefill: EngineState,
    plain: list[EngineState],
    costs: PathCosts,
    tokens: int,
    max_tokens: int,
    hashes: tuple[int, ...] = (),
    margin: float = 0.0,
) -> Choice:
    """The path of a prompt of `tokens` (`hashes`: its blocks, prefix.py) to be answered with
    up to `max_tokens`: pushed from `prefill`, or whole on one of `plain` (the healthy engines
    that may serve it whole). `margin`: a plain path must be expected sooner by this
    fraction."""
    if mode == "always" or not plain:
        return Choice("push")
    engine = plain_engine(plain, tokens, hashes)
    plain_choice = Choice("local" if engine.info.role == "decode" else "whole", engine)
    if mode == "never":
        return plain_choice
    s_p = prefill.rate.s_per_token
    if s_p is None:  # measure prefill first
        return Choice("push")
    if costs.push.value is None:
        return Choice("push", explored=True)
    if costs.plain.value is None:
        return Choice(plain_choice.path, engine, explored=True)
    s_e = engine.rate.s_per_token if engine.rate.s_per_token is not None else s_p
    after = max(max_tokens - 1, 0)
    push_s = first_token_s(prefill, tokens, hashes, s_p) + after * costs.push.value
    plain_s = first_token_s(engine, tokens, hashes, s_e) + after * costs.plain.value
    plain_wins = plain_s < push_s * (1 - margin)
    costs.turn += 1
    explore = costs.turn % EXPLORE_EVERY == 0
    if plain_wins != explore:
        return Choice(plain_choice.path, engine, push_s, plain_s, explore)
    return Choice("push", None, push_s, plain_s, explore)


def max_tokens_of(body: dict) -> int:
    """The most tokens a request may be answered with, as it says (else vLLM's default)."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_MAX_TOKENS
