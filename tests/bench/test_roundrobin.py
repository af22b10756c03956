"""The `replicas` baseline's front against fake engines: turns, streams, statuses. The same
front over real engines: tests/e2e/test_proxy.py."""

from __future__ import annotations

import httpx
import pytest

from kvpush.bench.roundrobin import build_app
from tests.proxy.fake_engine import fake_engine
from tests.servers import run_server


def test_requests_go_to_the_engines_in_turn_streams_and_statuses_unchanged():
    a, b = fake_engine(), fake_engine(behavior="400")
    with (
        run_server(a) as url_a,
        run_server(b) as url_b,
        run_server(build_app([url_a, url_b])) as front,
    ):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True}
        first = httpx.post(front + "/v1/completions", json=body, timeout=10)
        second = httpx.post(front + "/v1/completions", json=body, timeout=10)
        third = httpx.post(front + "/v1/completions", json=body, timeout=10)
        assert httpx.get(front + "/health").status_code == 200
    assert first.status_code == third.status_code == 200
    assert first.text.endswith("data: [DONE]\n\n") and first.text.count("data: ") == 4
    assert second.status_code == 400 and second.json()["error"]["message"] == "boom"
    assert len(a.state.requests) == 2 and len(b.state.requests) == 1
    assert a.state.requests[0] == body  # the body as sent


def test_a_front_needs_an_engine():
    with pytest.raises(ValueError, match="at least one engine"):
        build_app([])
