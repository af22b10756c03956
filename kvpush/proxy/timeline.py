"""One client request's timeline at the proxy, joined to the engines' by `transfer_id`.

Events are seconds from the request's arrival; a phase is the time between two events. Each
request adds one observation per phase to `kvpush_proxy_phase_seconds{phase}` and one debug log
line. Recording is a clock read per event, none per token.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("kvpush.proxy.timeline")

EVENTS = (
    "legs_sent",  # both legs (push) or the prefill leg (pull) handed to the HTTP client
    "prefill_answer",  # prefill's answer in
    "decode_headers",  # decode's response headers in
    "first_token",  # the client's first token ready: prefill's (kvpush, streamed) or decode's
    "first_chunk",  # decode's first chunk (streamed) or whole answer in hand
    "last_chunk",  # decode's stream ended
)
PHASES = {  # name: (from event, to event); "arrival" is 0
    "route": ("arrival", "legs_sent"),
    "prefill": ("legs_sent", "prefill_answer"),
    "push_tail": ("prefill_answer", "first_chunk"),  # prefill answered -> decode's first token
    "ttft": ("arrival", "first_token"),
    "decode_headers": ("legs_sent", "decode_headers"),
    "stream": ("first_chunk", "last_chunk"),
    "total": ("arrival", "last_chunk"),
}


@dataclass
class Trace:
    """One client request's ids and timeline."""

    client_id: str | None
    request_id: str = field(default_factory=lambda: f"kvpush-{uuid.uuid4().hex}")
    transfer_id: str = ""
    start: float = field(default_factory=time.monotonic)
    at: dict[str, float] = field(default_factory=lambda: {"arrival": 0.0})
    num_chunks: int = 0
    prompt_tokens: int = 0  # the dispatcher's estimate (dispatch.estimate_prompt_tokens)
    streamed: bool = False
    reroutes: list[str] = field(default_factory=list)  # "prefill", "decode" or "whole", per re-send
    migrations: list[str] = field(default_factory=list)  # the cause of each (proxy.migrate)
    path: str = ""  # the prompt's path (kvpush.proxy.paths): "push", "local" or "whole"
    measured: bool = False  # in the proxy's measure of its way of serving (paths.Ways)
    status: str = ""  # how it ended: "ok", or the failure
    observed: bool = False

    def mark(self, event: str) -> float:
        """Record `event` now (a later mark of the same event, after a re-send, wins)."""
        self.at[event] = offset = time.monotonic() - self.start
        return offset

    @property
    def dispatch_id(self) -> str:
        """The id both legs carry (X-Request-Id): fresh for each re-send and migration, so an
        engine never sees a re-sent request under the id of the one it just aborted."""
        n = len(self.reroutes) + len(self.migrations)
        return f"{self.request_id}-{n}" if n else self.request_id

    def phases(self) -> dict[str, float]:
        """Each phase whose two events were recorded, in seconds (never negative: prefill's
        answer may arrive just after decode's first token)."""
        return {
            name: max(0.0, self.at[b] - self.at[a])
            for name, (a, b) in PHASES.items()
            if a in self.at and b in self.at
        }

    @property
    def tpot_s(self) -> float | None:
        """Per streamed chunk after the first."""
        if self.num_chunks < 2 or "last_chunk" not in self.at:
            return None
        return (self.at["last_chunk"] - self.at["first_chunk"]) / (self.num_chunks - 1)

    def log(self) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        events = " ".join(f"{k}={v * 1e3:.1f}" for k, v in self.at.items())
        phases = " ".join(f"{k}={v * 1e3:.1f}" for k, v in self.phases().items())
        log.debug(
            "request %s transfer_id=%s client_id=%s path=%s status=%s re-sent=%s migrated=%s "
            "events_ms: %s; phases_ms: %s",
            self.request_id,
            self.transfer_id or "-",
            self.client_id or "-",
            self.path or "-",
            self.status or "-",
            ",".join(self.reroutes) or "-",
            ",".join(self.migrations) or "-",
            events,
            phases,
        )
