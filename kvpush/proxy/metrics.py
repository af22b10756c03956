"""The proxy's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

import collections
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpush.proxy.timeline import PHASES, Trace

RECENT_TIMELINES = 4096  # requests whose phases /timelines returns, newest last
_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# finer at the low end: the push tail's target is 10 ms
_PHASE_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvpush_proxy_requests",
            "requests by mode and HTTP status",
            ["mode", "status"],
            registry=r,
        )
        self.abandoned = Counter(
            "kvpush_proxy_abandoned",
            "push-mode requests that ended without decode's full answer, ABANDONed at prefill",
            registry=r,
        )
        self.rerouted = Counter(
            "kvpush_proxy_rerouted",
            "requests re-sent after an engine failed before the client got a byte: after "
            "their prefill engine failed, to another prefill engine or to decode as a plain "
            "request; after the engine answering them failed, whole to another engine; "
            "with no prefill engine with room (admission), to decode",
            ["to"],
            registry=r,
        )
        self.migrated = Counter(
            "kvpush_proxy_migrated",
            "streams continued on another engine after theirs failed mid-answer "
            "(kvpush.proxy.migrate), by cause: broken (connection lost), timeout, error (an "
            "error event), ended (the stream ended before [DONE]), prefill (its prefill engine "
            "was lost before decode's first chunk: its KV may never come), resume (the engine "
            "chosen to continue failed too)",
            ["cause"],
            registry=r,
        )
        self.lost = Counter(
            "kvpush_proxy_streams_failed",
            "streams ended with an error event after their engine failed mid-answer: they "
            "could not be continued (see kvpush.proxy.migrate), by cause as migrated",
            ["cause"],
            registry=r,
        )
        self.path = Counter(
            "kvpush_proxy_path",
            "requests by the path their prompt took (kvpush.proxy.paths): push (a prefill "
            "engine computed it, its KV pushed to decode), local (a decode engine served it "
            "whole) or whole (a prefill engine did)",
            ["path"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "kvpush_proxy_prefill_leg_seconds",
            "prefill leg latency",
            buckets=_BUCKETS_S,
            registry=r,
        )
        self.first_byte_seconds = Histogram(
            "kvpush_proxy_decode_first_byte_seconds",
            "time to decode's response headers",
            buckets=_BUCKETS_S,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvpush_proxy_ttft_seconds",
            "time to first byte of the answer",
            buckets=_BUCKETS_S,
            registry=r,
        )
        self.tpot_seconds = Histogram(
            "kvpush_proxy_tpot_seconds",
            "time per streamed chunk after the first",
            buckets=_BUCKETS_S,
            registry=r,
        )
        self.phase_seconds = Histogram(
            "kvpush_proxy_phase_seconds",
            "per-request timeline phases at the proxy (kvpush.proxy.timeline.PHASES): route, "
            "prefill, push_tail (prefill's answer to decode's first chunk), decode_headers, "
            "stream, total",
            ["phase"],
            buckets=_PHASE_BUCKETS_S,
            registry=r,
        )
        self._phases = {name: self.phase_seconds.labels(name) for name in PHASES}
        self.recent: collections.deque[dict] = collections.deque(maxlen=RECENT_TIMELINES)
        self.outstanding = Gauge(
            "kvpush_proxy_outstanding",
            "requests in flight per engine",
            ["engine", "role"],
            registry=r,
        )
        self.waiting = Gauge(
            "kvpush_proxy_decode_waiting_on_prefill",
            "decode requests whose blocks wait for prefill",
            ["engine"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvpush_proxy_engine_healthy",
            "1 if the engine passes health checks",
            ["engine", "role"],
            registry=r,
        )

        self.connections = Gauge(
            "kvpush_proxy_engine_connections_opened",
            "TCP connections opened to the engine since start: in steady use, about one per "
            "engine and concurrent request; one per request means connections are not reused",
            ["engine", "role"],
            registry=r,
        )

    def observe_latency(self, trace: Trace) -> None:
        """A request's timeline, once, however it ended; also logged at debug level."""
        if trace.observed:
            return
        trace.observed = True
        at = trace.at
        for histogram, value in (
            (self.prefill_seconds, trace.phases().get("prefill")),
            (self.first_byte_seconds, at.get("decode_headers")),
            (self.ttft_seconds, at.get("first_chunk")),
            (self.tpot_seconds, trace.tpot_s),
        ):
            if value is not None:
                histogram.observe(value)
        phases = trace.phases()
        for name, seconds in phases.items():
            self._phases[name].observe(seconds)
        self.recent.append(
            {
                "transfer_id": trace.transfer_id,
                "client_id": trace.client_id,  # the client's X-Request-Id, if it sent one
                "status": trace.status,
                "path": trace.path,
                "measured": trace.measured,  # in the measure of its way (paths.Ways)
                "prompt_tokens": trace.prompt_tokens,
                "streamed": trace.streamed,
                "migrations": list(trace.migrations),
                "chunks": trace.num_chunks,  # streamed chunks: about one a token
                "tpot_s": trace.tpot_s,  # per streamed chunk after the first
                "phases_s": phases,
                # the events too, and when it arrived on this host's monotonic clock, so that
                # a client on the same host can join its own times to the proxy's
                "events_s": dict(trace.at),
                "arrival_monotonic_s": trace.start,
            }
        )
        trace.log()

    def observe_pool(self, pool: Any) -> None:
        for s in pool.states:
            self.outstanding.labels(s.info.url, s.info.role).set(s.outstanding)
            self.healthy.labels(s.info.url, s.info.role).set(1 if s.healthy else 0)
            self.connections.labels(s.info.url, s.info.role).set(s.connections_opened)
            if s.info.role == "decode":
                self.waiting.labels(s.info.url).set(s.waiting_on_prefill)

    def render(self) -> bytes:
        return generate_latest(self.registry)
