"""Conditional disaggregation: for each request, the path its prompt takes.

- `push`: a prefill engine computes the prompt and pushes its KV to the decode engine (the
  disaggregated path);
- `local`: a decode engine serves the whole request, prompt and decode, as one plain engine;
- `whole`: a prefill engine serves the whole request, as one plain engine.

Disaggregation pays only where prefill's interference with decode costs more than the split
itself: a prefill engine has a share of the hardware, and the decode engine carries every
pushed request's decoding. Whether it pays depends on the hardware, the model and the load, so
`auto` measures it, between two ways of serving (`Ways`):

- `split`: every prompt pushed, decoding on the decode engines only;
- `plain`: every engine, prefill or decode, a plain replica, each request whole on the engine
  a plain replica's front would pick (`plain_engine`: the fewest prompt tokens to compute, its
  likely cached prefix left out, then the fewest streams decoding).

Mixing the two per request is worse than either (measured, docs/benchmarks.md): a prompt
computed on the decode engine stalls every pushed stream there, which is the interference
disaggregation exists to remove. So `auto` serves one way at a time, in cycles (`Ways`): the
current way for most of a cycle, the other way for its last `EXPLORE` requests, each run's
first `SETTLE` requests unmeasured (the other way's are still in flight); then it takes the
other way if that run's requests ended sooner than the current way's recent ones: median
TTFT + (median tokens - 1) x median TPOT, by more than `MARGIN`. It starts `plain`: as
plain replicas, until disaggregating is measured better.
`always`: every prompt pushed (kvpush before issue 44). `never`: every engine a plain
replica.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.proxy.config import EngineState

DISAGGREGATION = ("auto", "always", "never")
PATHS = ("push", "local", "whole")
SPLIT, PLAIN = "split", "plain"
WAYS = (SPLIT, PLAIN)
CYCLE = 64  # requests per cycle; its last EXPLORE take the other way
EXPLORE = 12
SETTLE = 4  # the first requests of a run of one way, not measured
MIN_SAMPLES = 4  # measured requests of each way before they are compared
WINDOW = 24  # the current way's measured streams whose medians are compared
MARGIN = 0.05  # the other way must be this much sooner to be taken
_WEIGHT = 0.2  # of each new observation in PrefillRate: the last ten or so requests count


@dataclass
class PrefillRate:
    """Seconds per prompt token an engine takes to answer a prompt's first token, queue
    included: each observation is the seconds from sending the request to its first token,
    over the prompt tokens that were queued on the engine ahead of it plus its own; a moving
    average, each observation moving it `_WEIGHT` of the way. Reported in /status."""

    s_per_token: float | None = None
    samples: int = 0

    def observe_prompt(self, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate, prev = seconds / tokens, self.s_per_token
        self.s_per_token = rate if prev is None else prev + _WEIGHT * (rate - prev)
        self.samples += 1


@dataclass
class Ways:
    """`auto`'s two ways of serving, measured: the way for each next request.

    Requests come in cycles of `CYCLE`: the current way for all but the last `EXPLORE`, the
    other way for those, so that each way is measured in its own steady state (requests of
    the two ways mixed would measure the mix). The first `SETTLE` requests of each run of a
    way are not measured: the other way's are still in flight. `SETTLE` requests into the
    next cycle, once the explored ones have mostly ended, the ways are compared."""

    current: str = PLAIN  # never worse than plain replicas until measured better
    turn: int = 0  # requests sent in this cycle
    # per way: its last measured streams' (TTFT s, TPOT s, chunks)
    done: dict[str, deque] = field(default_factory=lambda: {w: deque(maxlen=WINDOW) for w in WAYS})

    def next(self) -> tuple[str, bool]:
        """The way for the next request, and whether it is measured."""
        if self.turn == SETTLE:
            self._decide()
        if self.turn == CYCLE:
            self.turn = 0
        self.turn += 1
        explore_from = CYCLE - EXPLORE
        if self.turn > explore_from:
            return _other(self.current), self.turn > explore_from + SETTLE
        return self.current, self.turn > SETTLE

    def observe(self, path: str, ttft_s: float | None, tpot_s: float | None, chunks: int) -> None:
        """A measured stream served `path` ended well."""
        if path not in PATHS or ttft_s is None or tpot_s is None or tpot_s <= 0:
            return
        self.done[SPLIT if path == "push" else PLAIN].append((ttft_s, tpot_s, chunks))

    def cost(self, way: str, last: int = WINDOW) -> float | None:
        """The seconds this way's last measured requests took to their last token (medians)."""
        done = list(self.done[way])[-last:]
        if len(done) < MIN_SAMPLES:
            return None
        ttft, tpot, chunks = (statistics.median(x) for x in zip(*done, strict=True))
        return ttft + max(chunks - 1, 0) * tpot

    def _decide(self) -> None:
        """The other way's last explored run against the current way's recent requests."""
        other = _other(self.current)
        here, there = self.cost(self.current), self.cost(other, EXPLORE - SETTLE)
        if here is not None and there is not None and there < here * (1 - MARGIN):
            self.current = other


def _other(way: str) -> str:
    return PLAIN if way == SPLIT else SPLIT


@dataclass(frozen=True)
class Choice:
    path: str
    engine: EngineState | None = None  # the engine serving it whole (`local`, `whole`)
    measured: bool = False  # in `auto`'s measure of its way


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


def choose(
    mode: str,
    plain: list[EngineState],
    ways: Ways,
    tokens: int,
    hashes: tuple[int, ...] = (),
) -> Choice:
    """The path of a prompt of `tokens` (`hashes`: its blocks, prefix.py): pushed, or whole
    on one of `plain` (the healthy engines that may serve it whole)."""
    if mode == "always" or not plain:
        return Choice("push")
    measured = False
    if mode == "auto":
        way, measured = ways.next()
        if way == SPLIT:
            return Choice("push", measured=measured)
    engine = plain_engine(plain, tokens, hashes)
    return Choice("local" if engine.info.role == "decode" else "whole", engine, measured)
