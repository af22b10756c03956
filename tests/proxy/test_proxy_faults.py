"""Proxy behaviour on bad input and on upstream faults (fake upstreams: see fake_engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
import zmq

from kvpush import httpclient
from kvpush.proxy.app import POOL, create_app
from kvpush.proxy.config import EngineInfo, ProxyConfig
from kvpush.proxy.pool import EnginePool
from kvpush.transfer import wire
from tests.proxy.fake_engine import fake_engine
from tests.servers import metric_samples, run_server


def wait_for(condition, message: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


@contextlib.contextmanager
def proxied(
    prefill_behavior="ok", decode_behavior="ok", decode_model="tiny", side_port=5600, **settings
):
    p_app, d_app = fake_engine("tiny", prefill_behavior), fake_engine(decode_model, decode_behavior)
    with run_server(p_app) as p_url, run_server(d_app) as d_url:
        engines = (
            EngineInfo(p_url, "prefill", "p0", side_channel_port=side_port),
            EngineInfo(d_url, "decode", "d0"),
        )
        settings.setdefault("disaggregation", "always")  # the push path: its faults
        config = ProxyConfig(engines=engines, **settings)
        with run_server(create_app(config)) as url:
            yield url, p_app, d_app


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        (b"not json", 400, "not JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens must be an integer >= 1"),
        (b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
        (b'{"prompt": "hi", "stream": "yes"}', 400, "stream must be"),
        (b'{"prompt": 5}', 400, "prompt must be"),
        (b'{"prompt": "hi", "kv_transfer_params": {}}', 400, "set by the proxy"),
        (b'{"prompt": ["a", "b"]}', 400, "one prompt per request"),
        (b'{"prompt": "hi", "model": "gpt-9"}', 404, "served: ['tiny']"),
    ],
)
def test_bad_input_is_refused_without_touching_engines(body, status, text):
    with proxied() as (url, p_app, d_app):
        r = httpx.post(url + "/v1/completions", content=body)
        assert r.status_code == status and text in r.json()["error"]["message"]
        assert p_app.state.requests == [] and d_app.state.requests == []


def test_push_legs_carry_the_params_and_prefill_makes_one_token():
    with proxied() as (url, p_app, d_app):
        r = httpx.post(
            url + "/v1/completions", json={"prompt": "hi", "max_tokens": 9, "min_tokens": 3}
        )
        assert r.status_code == 200
        wait_for(lambda: len(p_app.state.requests) == 1, "the prefill leg never arrived")
        (p_body,), (d_body,) = p_app.state.requests, d_app.state.requests
        assert p_body["max_tokens"] == 1 and p_body["min_tokens"] == 1 and not p_body["stream"]
        tid = p_body["kv_transfer_params"]["transfer_id"]
        remote_request_id = d_body["kv_transfer_params"].pop("remote_request_id")
        assert remote_request_id.startswith("cmpl-kvpush-") and remote_request_id.endswith("-0")
        assert d_body["kv_transfer_params"] == {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_engine_id": "p0",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "pp_size": 1,
        }
        assert d_body["max_tokens"] == 9


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_400_is_returned_as_it_is_and_cancels_decode(stream):
    """The request itself was bad: it is not re-sent anywhere. Decode has not accepted it, so
    a streamed request gets the 400 too."""
    with proxied(prefill_behavior="400", decode_behavior="hang") as (url, p_app, d_app):
        body = {"prompt": "hi", "stream": stream}
        r = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 400 and "prefill engine" in r.json()["error"]["message"]
        assert len(p_app.state.requests) == 1 and len(d_app.state.requests) <= 1
        # decode's leg was closed, before or after it reached decode
        time.sleep(0.3)
        wait_for(lambda: d_app.state.disconnected == len(d_app.state.requests), "leg not closed")
        status = httpx.get(url + "/status").json()
        assert all(e["outstanding"] == 0 for e in status["engines"])


def test_a_prefill_400_after_decode_accepted_ends_the_stream_with_an_error_event():
    """Decode accepted the streamed request (its headers), so the client's 200 headers went
    out: prefill's 400, later, ends the stream as an error event naming it; decode's leg is
    closed and nothing is held."""
    behaviors = {"prefill_behavior": "400-late", "decode_behavior": "late-first-chunk"}
    with proxied(**behaviors) as (url, p_app, d_app):
        body = {"prompt": "hi", "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            text = r.read().decode()
        assert '"code":400' in text and "prefill engine" in text and "boom" in text
        assert text.endswith("data: [DONE]\n\n") and "late" not in text
        wait_for(lambda: d_app.state.stream_closed, "decode's leg not closed")
        status = httpx.get(url + "/status").json()
        assert all(e["outstanding"] == 0 for e in status["engines"])


def test_a_failed_only_prefill_engine_leaves_decode_to_compute_the_prompt():
    # decode answers after 1 s, so prefill's 500 comes first, as it would in real push mode
    with proxied(prefill_behavior="500", decode_behavior="slow") as (url, p_app, d_app):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        first, second = d_app.state.requests
        assert "kv_transfer_params" in first and "kv_transfer_params" not in second
        assert second["prompt"] == "hi" and len(p_app.state.requests) == 1
        assert metric_samples(url)['kvpush_proxy_rerouted_total{to="decode"}'] == 1
        status = httpx.get(url + "/status").json()
        assert all(e["outstanding"] == 0 for e in status["engines"])


def test_a_failed_prefill_engine_is_retried_once_on_another_with_a_new_transfer_id():
    bad, good, d_app = fake_engine(behavior="500"), fake_engine(), fake_engine(behavior="slow")
    with run_server(bad) as b_url, run_server(good) as g_url, run_server(d_app) as d_url:
        engines = (EngineInfo(b_url, "prefill", "p0"), EngineInfo(g_url, "prefill", "p1"))
        config = ProxyConfig(
            engines=engines + (EngineInfo(d_url, "decode"),), disaggregation="always"
        )
        with run_server(create_app(config)) as url:
            body = {"prompt": "hi", "stream": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=10)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            metrics = metric_samples(url)
    ((b_body,), (g_body,)) = bad.state.requests, good.state.requests
    first, second = (d["kv_transfer_params"] for d in d_app.state.requests)
    assert first["transfer_id"] == b_body["kv_transfer_params"]["transfer_id"]
    assert second["transfer_id"] == g_body["kv_transfer_params"]["transfer_id"]
    assert first["transfer_id"] != second["transfer_id"]
    assert (first["remote_engine_id"], second["remote_engine_id"]) == ("p0", "p1")
    assert metrics['kvpush_proxy_rerouted_total{to="prefill"}'] == 1


def test_decode_500_becomes_502_naming_the_transfer():
    with proxied(decode_behavior="500") as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 502
        assert "KV transfer failed for transfer_id" in r.json()["error"]["message"]


def test_only_a_request_that_ends_early_is_abandoned_at_prefill():
    """The prefill engine's side channel is a bare ZMQ socket here: an answered request sends
    nothing to it; one whose decode leg failed sends ABANDON for its transfer_id."""
    ctx = zmq.Context()
    side = ctx.socket(zmq.ROUTER)
    try:
        port = side.bind_to_random_port("tcp://127.0.0.1")
        with proxied(side_port=port) as (url, p_app, d_app):
            assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
            assert not side.poll(500)
            d_app.state.behavior = "500"
            assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 502
            # decode's 500 can cancel the prefill leg before prefill saw it: read decode's
            tid = d_app.state.requests[-1]["kv_transfer_params"]["transfer_id"]
            assert side.poll(5000), "no ABANDON reached prefill's side channel"
            env = wire.decode_envelope(side.recv_multipart()[-1])
    finally:
        side.close()
        ctx.term()
    assert isinstance(env.msg, wire.AbandonMsg) and env.reply_to == ""
    assert env.msg.key == wire.TransferKey(tid, 0)


def test_hung_upstream_times_out_instead_of_hanging():
    with proxied(decode_behavior="hang", request_timeout_s=1.0) as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 504 and "request_timeout_s=1.0" in r.json()["error"]["message"]


def test_500_mid_stream_ends_the_stream_with_an_error_event():
    async def read(url: str) -> tuple[int, list[dict]]:
        async with (
            httpclient.session() as c,
            c.post(url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r,
        ):
            return r.status, [event async for event in httpclient.sse_events(r)]

    with proxied(decode_behavior="500-mid-stream") as (url, _, _):
        status, events = asyncio.run(read(url))
    assert status == 200 and events[0]["choices"][0]["text"] == "0"
    assert "mid-stream" in events[-1]["error"]["message"]  # then [DONE], which ends sse_events


def test_slow_first_byte_is_waited_for():
    with proxied(decode_behavior="slow") as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=10)
        assert r.status_code == 200 and "[DONE]" in r.text


def test_backpressure_answers_503_with_retry_after():
    with proxied(max_decode_prompt_tokens=10, admission_wait_s=0.2) as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": list(range(3, 50))})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_start_up_refuses_a_served_model_name_mismatch():
    with run_server(fake_engine("tiny")) as p_url, run_server(fake_engine("other")) as d_url:
        config = ProxyConfig(engines=(EngineInfo(p_url, "prefill"), EngineInfo(d_url, "decode")))
        with pytest.raises(RuntimeError, match="serves \\['tiny'\\].*serves \\['other'\\]"):
            asyncio.run(EnginePool(config).start())


def test_decode_engine_down_before_dispatch_is_skipped():
    p_app, d_app = fake_engine(), fake_engine()
    with run_server(p_app) as p_url, run_server(d_app) as d_url:
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        engines = (
            EngineInfo(p_url, "prefill"),
            EngineInfo(dead, "decode"),
            EngineInfo(d_url, "decode"),
        )
        config = ProxyConfig(engines=engines, disaggregation="always")
        with run_server(create_app(config)) as url:
            for _ in range(4):
                assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
            status = {e["url"]: e for e in httpx.get(url + "/status").json()["engines"]}
            assert status[dead]["healthy"] is False
            assert len(d_app.state.requests) == 4


def test_pull_mode_sends_decode_what_prefill_returned():
    with proxied(connector="nixl-pull") as (url, p_app, d_app):
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
        assert d_app.state.requests[0]["kv_transfer_params"] == {"x": 1}


def test_metrics_and_models_and_health():
    with proxied() as (url, _, _):
        httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        metrics = metric_samples(url)
        assert metrics['kvpush_proxy_requests_total{mode="push",status="200"}'] == 1
        assert "kvpush_proxy_decode_waiting_on_prefill" in metrics
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        assert httpx.get(url + "/health").status_code == 200


def test_request_id_is_echoed_and_each_dispatch_gets_a_fresh_one():
    with proxied() as (url, p_app, d_app):
        r = httpx.post(
            url + "/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "c1"}
        )
        assert r.headers["x-request-id"] == "c1"
        sent = d_app.state.headers["x-request-id"]
        # decode's answer does not wait for the prefill leg (the fakes answer in any order)
        wait_for(lambda: len(p_app.state.requests) == 1, "the prefill leg never arrived")
        assert sent.startswith("kvpush-") and p_app.state.headers["x-request-id"] == sent
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        # without a client id the answer names the dispatch's own, fresh each time
        assert d_app.state.headers["x-request-id"] == r.headers["x-request-id"] != sent


def test_least_outstanding_sends_the_next_request_to_the_idle_engine():
    slow, fast = fake_engine(behavior="slow"), fake_engine()
    with run_server(slow) as s_url, run_server(fast) as f_url, run_server(fake_engine()) as d_url:
        engines = (EngineInfo(s_url, "prefill"), EngineInfo(f_url, "prefill"))
        engines += (EngineInfo(d_url, "decode"),)
        config = ProxyConfig(engines=engines, policy="least-outstanding", connector="nixl-pull")
        with run_server(create_app(config)) as url:

            async def go():
                async with httpx.AsyncClient(timeout=30) as c:
                    first = asyncio.create_task(
                        c.post(url + "/v1/completions", json={"prompt": "a"})
                    )
                    await asyncio.sleep(0.3)  # the first request is in flight on the slow engine
                    for _ in range(3):
                        r = await c.post(url + "/v1/completions", json={"prompt": "b"})
                        assert r.status_code == 200
                    assert (await first).status_code == 200

            asyncio.run(go())
            # ties go to the first engine; while it is busy every request goes to the other
            assert len(slow.state.requests) == 1 and len(fast.state.requests) == 3


def test_an_engine_that_fails_health_checks_leaves_rotation_and_comes_back():
    p1, p2 = fake_engine(), fake_engine()
    with run_server(p1) as u1, run_server(p2) as u2, run_server(fake_engine()) as d_url:
        engines = (
            EngineInfo(u1, "prefill"),
            EngineInfo(u2, "prefill"),
            EngineInfo(d_url, "decode"),
        )
        config = ProxyConfig(engines=engines, health_interval_s=0.05, disaggregation="always")
        app = create_app(config)
        with run_server(app) as url:
            first = app[POOL].states[0]  # u1's state: its `down` event (proxy/relay.py)

            def healthy() -> bool:
                status = httpx.get(url + "/status").json()["engines"]
                return next(e for e in status if e["url"] == u1)["healthy"]

            def wait_health(want: bool) -> None:
                wait_for(lambda: healthy() == want, f"engine health never became {want}", 10)

            assert not first.down.is_set()
            p1.state.behavior = "down"
            wait_health(False)
            assert first.down.is_set()  # streams waiting on its pushes move on
            for _ in range(4):
                assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
            wait_for(lambda: len(p2.state.requests) == 4, "prefill legs missing")
            assert len(p1.state.requests) == 0
            p1.state.behavior = "ok"
            wait_health(True)
            assert not first.down.is_set()  # a fresh event for its next spell out
            for _ in range(4):
                assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
            wait_for(lambda: len(p1.state.requests) + len(p2.state.requests) == 8, "legs missing")
            assert len(p1.state.requests) == 2 and len(p2.state.requests) == 6


def test_client_leaving_mid_stream_closes_decode_at_once():
    """The real-engine version is in tests/e2e/test_proxy.py; this one pins the mechanism: the
    decode connection closes as the client leaves, not when a later write fails."""
    with proxied(decode_behavior="endless") as (url, _, d_app):

        async def go():
            async with httpx.AsyncClient(timeout=30) as c:

                async def read():
                    body = {"prompt": "hi", "stream": True}
                    async with c.stream("POST", url + "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass

                task = asyncio.create_task(read())
                await asyncio.sleep(0.5)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                deadline = time.monotonic() + 2
                while not d_app.state.stream_closed:
                    assert time.monotonic() < deadline, "decode's stream still open after 2 s"
                    await asyncio.sleep(0.02)
                status = (await c.get(url + "/status")).json()
                assert all(e["outstanding"] == 0 for e in status["engines"])

        asyncio.run(go())
