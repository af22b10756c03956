"""The front end (kvpush.proxy.frontend) on prefill faults a real engine cannot produce on
demand: it wraps a fake engine's app (fake_engine.py) as it wraps vLLM's, in front of a fake
decode engine. Its happy paths run in a real prefill engine: tests/e2e/test_frontend.py."""

from __future__ import annotations

import contextlib

import httpx

from kvpush.proxy.config import EngineInfo, ProxyConfig
from kvpush.proxy.frontend import FrontEnd
from tests.proxy.fake_engine import fake_engine
from tests.proxy.test_proxy_faults import wait_for
from tests.servers import free_port, metric_samples, run_server


class RaisingOnCompletions:
    """An app whose completions route raises instead of answering (an engine that died
    under its API server), everything else answered by `app`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            raise RuntimeError("engine core died")
        await self.app(scope, receive, send)


@contextlib.contextmanager
def front_end(prefill_app, decode_behavior="slow"):
    """The front end around `prefill_app` on a port of its own; decode answers after 1 s, so
    a prefill failure comes first, as with real engines."""
    d_app = fake_engine("tiny", decode_behavior)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with run_server(d_app) as d_url:
        engines = (EngineInfo(url, "prefill", "p0"), EngineInfo(d_url, "decode", "d0"))
        app = FrontEnd(prefill_app, ProxyConfig(engines=engines, disaggregation="always"))
        with run_server(app, port):
            yield url, d_app


def test_a_prefill_500_leaves_decode_to_compute_the_prompt():
    p_app = fake_engine("tiny", "500")
    with front_end(p_app) as (url, d_app):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        first, second = d_app.state.requests
        assert "kv_transfer_params" in first and "kv_transfer_params" not in second
        (leg,) = p_app.state.requests  # the in-process leg, as the proxy would have sent it
        assert leg["max_tokens"] == 1 and leg["kv_transfer_params"]["do_remote_decode"]
        assert metric_samples(url + "/kvpush")['kvpush_proxy_rerouted_total{to="decode"}'] == 1


def test_a_prefill_app_that_raises_leaves_decode_to_compute_the_prompt():
    with front_end(RaisingOnCompletions(fake_engine("tiny"))) as (url, d_app):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        assert "kv_transfer_params" not in d_app.state.requests[-1]
        status = httpx.get(url + "/kvpush/status").json()
        assert all(e["outstanding"] == 0 for e in status["engines"])


def test_a_prefill_400_is_returned_as_it_is():
    with front_end(fake_engine("tiny", "400")) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 400 and "boom" in r.json()["error"]["message"]


def test_a_prefill_400_after_decode_accepted_ends_the_stream_with_an_error_event():
    """As through the proxy: the client's 200 headers went out when decode accepted."""
    with front_end(fake_engine("tiny", "400-late"), "late-first-chunk") as (url, d_app):
        body = {"prompt": "hi", "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            text = r.read().decode()
        assert '"code":400' in text and "boom" in text and text.endswith("data: [DONE]\n\n")
        wait_for(lambda: d_app.state.stream_closed, "decode's leg not closed")
        status = httpx.get(url + "/kvpush/status").json()
        assert all(e["outstanding"] == 0 for e in status["engines"])


def test_a_proxys_leg_and_the_off_header_reach_the_engine_untouched():
    p_app = fake_engine("tiny")
    with front_end(p_app, decode_behavior="ok") as (url, d_app):
        leg = {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}
        assert httpx.post(url + "/v1/completions", json=leg, timeout=10).status_code == 200
        off = {"X-KVPush-Front-End": "off"}
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers=off, timeout=10)
        assert r.status_code == 200
        assert p_app.state.requests == [leg, {"prompt": "hi"}] and d_app.state.requests == []
        assert httpx.get(url + "/kvpush/timelines").json() == {"timelines": []}
