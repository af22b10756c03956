"""The proxy in front of real engines: two prefill engines with different engine ids (the case
vLLM's demo proxy gets wrong), streaming and chat, and a client that goes away mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import replace

import pytest

from kvpush.bench.slo import SloConfig
from kvpush.proxy.app import create_app
from kvpush.proxy.config import EngineInfo, ProxyConfig
from kvpush.proxy.timeline import EVENTS, PHASES
from tests.e2e.client import (
    abort_after,
    body,
    kv_usage,
    metric_samples,
    plain,
    post,
    session,
    text_of,
    tokens,
    wait_idle,
)
from tests.e2e.conftest import free_port, start
from tests.proxy.fake_engine import fake_engine
from tests.servers import run_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def proxy_url(engines):
    spec = engines["prefill"].spec
    side = free_port()
    other = replace(
        spec, port=free_port(), engine_id=f"prefill-b-{side}", side_channel_port=side, block_size=64
    )
    (second,) = start(other)
    infos = [
        EngineInfo(e.spec.url, "prefill", e.spec.name, "127.0.0.1", e.spec.side_channel_port)
        for e in (engines["prefill"], second)
    ] + [EngineInfo.from_dict(engines["decode"].spec.describe())]
    with run_server(create_app(ProxyConfig(engines=tuple(infos), disaggregation="always"))) as url:
        yield url, [engines["prefill"].spec.url, second.spec.url], engines["decode"].spec.url
    second.stop()


def transfers(url: str) -> float:
    return metric_samples(url)["kvpush:transfers_total"]


def test_two_prefill_engines_each_request_decodes_right(proxy_url, mono_url):
    url, prefill_urls, _ = proxy_url
    before = [transfers(u) for u in prefill_urls]

    async def go():
        async with session() as c:
            for i in range(6):
                p = tokens(200 + 50 * i, 300 + i)
                want = await plain(c, mono_url, p, 12)
                got = await post(c, url, body(p, 12))
                assert text_of(got) == text_of(want), f"request {i}"

    asyncio.run(go())
    after = [transfers(u) for u in prefill_urls]
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3]  # round-robin


@pytest.mark.parametrize(("chat", "stream"), [(False, True), (True, False), (True, True)])
def test_streaming_and_chat_through_the_proxy(proxy_url, mono_url, chat, stream):
    url, _, _ = proxy_url
    prompt = "Return the number of items in the list, counting nested lists once. " * 5

    async def go():
        async with session() as c:
            want = await plain(c, mono_url, prompt, 12, chat=chat, stream=stream)
            got = await post(c, url, body(prompt, 12, chat=chat, stream=stream), chat=chat)
            return text_of(want), text_of(got)

    want, got = asyncio.run(go())
    assert got == want


def phase_counts(url: str) -> dict[str, float]:
    """kvpush:phase_seconds observations on an engine, by phase."""
    out: dict[str, float] = {}
    for key, value in metric_samples(url).items():
        if key.startswith("kvpush:phase_seconds_count{"):
            phase = key.split('phase="')[1].split('"')[0]
            out[phase] = out.get(phase, 0) + value
    return out


def test_each_request_records_its_timeline_in_order_and_the_phases_add_up(proxy_url):
    url, prefill_urls, decode_url = proxy_url
    before = {u: phase_counts(u) for u in (*prefill_urls, decode_url)}

    async def go():
        async with session() as c:
            await post(c, url, body(tokens(300, 31), 16, stream=True))
            async with c.get(url + "/timelines") as r:
                return (await r.json())["timelines"][-1]

    sent = time.monotonic()
    timeline = asyncio.run(go())
    phases = timeline["phases_s"]
    # the events too, and the arrival on this host's monotonic clock, for a client to join
    assert sent < timeline["arrival_monotonic_s"] < time.monotonic()
    assert (
        set(timeline["events_s"]) == {"arrival", *EVENTS} and timeline["events_s"]["arrival"] == 0
    )
    assert timeline["status"] == "ok" and len(timeline["transfer_id"]) == 32
    assert set(phases) == set(PHASES)  # every phase of the timeline
    assert phases["prefill"] > 0 and phases["stream"] > 0  # 16 tokens take decode steps
    parts = phases["route"] + phases["prefill"] + phases["push_tail"] + phases["stream"]
    # exact when prefill's answer came before decode's first token; else push_tail is 0 and
    # the parts overlap by the difference
    assert parts == pytest.approx(phases["total"], abs=1e-6) or parts > phases["total"]
    # and each engine's connector recorded its own phases of the same request
    want = {
        "prefill": {"handover", "next_step", "pair_and_post", "write", "release"},
        "decode": {"register", "wait_writes", "scatter", "report"},  # this pair stages
    }
    # decode's "land" starts at prefill's POSTED, which the WRITE's notification may overtake:
    # then the transfer has ended when POSTED comes, and land is not recorded; prefill's
    # "head_start" only when the scheduler's SOURCE came before the worker's push
    maybe = {"land", "head_start"}
    deadline = time.monotonic() + 5
    while True:
        grew = {
            u: {p for p, n in phase_counts(u).items() if n > before[u].get(p, 0)} for u in before
        }
        prefill_grew = [g for u, g in grew.items() if u != decode_url and g]
        prefill_ok = [g - maybe for g in prefill_grew] == [want["prefill"]]
        if prefill_ok and grew[decode_url] - maybe == want["decode"]:
            break
        assert time.monotonic() < deadline, grew
        time.sleep(0.1)


def test_the_schedulers_source_starts_pushes_before_the_next_engine_step(proxy_url):
    """These engines run early_source: prefill's scheduler sends SOURCE to its ranks when a
    request finishes. It races the worker's push one engine step later, so one win in four
    requests is asked for (the correctness tests check the answers on this pair)."""
    url, prefill_urls, _ = proxy_url

    def head_starts() -> float:
        return sum(phase_counts(u).get("head_start", 0) for u in prefill_urls)

    before = head_starts()

    async def go():
        async with session() as c:
            for i in range(4):
                answer = await post(c, url, body(tokens(120, 60 + i), 4))
                assert answer["choices"][0]["finish_reason"] == "length", answer

    asyncio.run(go())
    deadline = time.monotonic() + 5  # the engines' stats reach /metrics with a later step
    while head_starts() <= before:
        assert time.monotonic() < deadline, "no push started from SOURCE in four requests"
        time.sleep(0.1)


def test_client_disconnect_mid_stream_frees_both_engines(proxy_url):
    url, prefill_urls, decode_url = proxy_url

    async def go():
        async with session() as c:
            # 3,000 tokens would take decode half a minute: freeing within 10 s means the
            # proxy's disconnect reached decode, which aborted the request.
            b = body(tokens(60, 9), 3000, stream=True, ignore_eos=True)
            await abort_after(post(c, url, b), 1.5)  # mid-decode

    asyncio.run(go())
    wait_idle(*prefill_urls, decode_url, timeout_s=10)
    with urllib.request.urlopen(url + "/status", timeout=10) as r:
        status = json.load(r)
    assert all(e["outstanding"] == 0 for e in status["engines"])


def test_decode_leg_lost_before_decode_saw_it_prefill_freed_by_abandon(engines):
    """A real prefill engine, and a fake decode engine that never answers: it stands for a decode
    leg aborted before decode's engine saw it, which a real engine cannot be made to do on
    demand. Nobody registers, so prefill holds its blocks; when the client leaves, the proxy
    ABANDONs the transfer at prefill, which frees them within 3 s, not at the lease (30 s)."""
    prefill = engines["prefill"].spec
    wait_idle(prefill.url, timeout_s=40)  # an earlier test's lease may still run
    with run_server(fake_engine(behavior="hang")) as fake_url:
        side = prefill.side_channel_port
        infos = (
            EngineInfo(prefill.url, "prefill", prefill.name, "127.0.0.1", side),
            EngineInfo(fake_url, "decode", "fake-decode"),
        )
        with run_server(create_app(ProxyConfig(engines=infos, disaggregation="always"))) as url:

            async def go():
                async with session() as c:
                    task = asyncio.ensure_future(post(c, url, body(tokens(300, 21), 4)))
                    for _ in range(200):  # until prefill's leg finished and holds its blocks
                        await asyncio.sleep(0.05)
                        if await asyncio.to_thread(kv_usage, prefill.url) > 0:
                            break
                    held = await asyncio.to_thread(kv_usage, prefill.url)
                    await abort_after(task, 0)
                    return held

            held = asyncio.run(go())
            assert held > 0
            took = wait_idle(prefill.url, timeout_s=3)
            abandoned = metric_samples(url)["kvpush_proxy_abandoned_total"]
    assert abandoned == 1
    assert took < 3


def test_bench_sweep_writes_vllms_json_with_kvpushs_additions_and_plots_it(
    proxy_url, tiny_model, prompt_source, tmp_path
):
    """A short real sweep through the proxy: each point one `vllm bench serve`, its JSON under
    the seed's name, kvpush's fields added; `kvpush plot` draws it."""
    import json

    from kvpush.bench import plot
    from kvpush.bench.serve import sweep

    url, prefill_urls, decode_url = proxy_url
    paths = sweep(
        "kvpush", url, [4.0, 8.0], [64], [4], iterations=1, num_prompts=4, results_dir=tmp_path,
        tokenizer=str(tiny_model), prompts=prompt_source, slo=SloConfig(10_000, 1_000),
        metrics_urls=(*prefill_urls, decode_url),
    )  # fmt: skip
    assert [p.name for p in paths] == [
        "kvpush_qps4_in64_out4_iter0.json",
        "kvpush_qps8_in64_out4_iter0.json",
    ]
    data = json.loads(paths[0].read_text())
    # vLLM's own fields: its definitions, its percentiles (numpy's)
    for field in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                  "median_itl_ms", "p99_itl_ms", "p99_e2el_ms", "request_throughput",
                  "ttfts", "itls", "backend", "request_rate"):  # fmt: skip
        assert field in data, field
    assert data["completed"] == 4 and data["failed"] == 0
    assert data["input_lens"] == [64] * 4 and data["output_lens"] == [4] * 4  # exact lengths
    assert data["request_rate"] == 4.0
    # kvpush's: the grid point, and what it sampled from the proxy during the run
    assert (data["mode"], data["qps"], data["input_len"], data["output_len"]) == (
        "kvpush", 4.0, 64, 4)  # fmt: skip
    assert data["hardware"]["cpus"] >= 1 and data["short_outputs"] == 0
    assert data["decode_waiting_on_prefill"]["samples"] >= 1
    # fresh prompts: the shared engines served many requests before, none of these
    assert data["prompts"]["seed"] == prompt_source.seed
    cache = data["prefix_cache"]
    assert set(cache) == {*prefill_urls, decode_url}
    assert all(c["hits"] == 0 for c in cache.values()), cache
    assert sum(cache[u]["queries"] for u in prefill_urls) >= 4 * 64
    # goodput, with targets every request meets here, and vLLM's own count of it
    assert data["slo"] == {"ttft_ms": 10_000, "tpot_ms": 1_000}
    assert data["slo_attainment"] == 1.0 and data["request_goodput"] > 0
    phases = data["proxy_phases_ms"]  # the proxy's timeline: every phase of the 4 requests
    assert set(phases) == set(PHASES)
    assert all(p["count"] == 4 for p in phases.values())
    assert plot.main(tmp_path) == 0
    for metric, stat in plot.FIGURES:
        assert (tmp_path / f"{metric}_{stat}.png").stat().st_size > 1000
    assert (tmp_path / "ttft_breakdown.png").exists()
    assert (tmp_path / "slo_attainment.png").exists()


def test_the_replicas_front_deals_requests_in_turn_and_a_repeated_seed_shows_as_hits(
    engines, tiny_model, prompt_source, tmp_path, capsys
):
    """The `replicas` baseline's round-robin front over two real engines, through one sweep:
    each engine gets half the prompts, and neither has seen any (hits 0). The same prompts
    again (as a second run with the same --seed against a live deployment would send them)
    hit the caches, and the sweep says so."""
    from kvpush.bench.roundrobin import build_app
    from kvpush.bench.serve import sweep

    urls = (engines["mono"].spec.url, engines["decode"].spec.url)  # both cache prefixes
    runs = []
    for n in range(2):  # a new front each time, so each prompt goes to the same engine again
        with run_server(build_app(list(urls))) as front:
            runs.append(sweep(
                "replicas", front, [4.0], [256], [4], iterations=1, num_prompts=4,
                results_dir=tmp_path / str(n), tokenizer=str(tiny_model), prompts=prompt_source,
                metrics_urls=urls, first_iteration=300,
            ))  # fmt: skip
    first, again = (json.loads(paths[0].read_text()) for paths in runs)
    assert first["completed"] == 4 and first["failed"] == 0
    assert [c["queries"] for c in first["prefix_cache"].values()] == [2 * 256, 2 * 256]
    assert all(c["hits"] == 0 for c in first["prefix_cache"].values())
    # blocks of 64 tokens; a prompt's last token is always computed: 192 of each 256 hit
    assert sum(c["hits"] for c in again["prefix_cache"].values()) >= 192
    out = capsys.readouterr().out
    assert "WARNING replicas qps=4 in=256 out=4 iter=300: prefix-cache hits" in out


def test_a_json_from_vllm_bench_serve_itself_plots(engines, tiny_model, tmp_path):
    """Results someone's own `vllm bench serve` wrote (here against the plain engine and the
    decode engine, named the seed's way as push and pull) plot, push against pull. It runs
    vLLM's own bench serve with vLLM's options only, none of kvpush's sweep."""
    import subprocess

    from kvpush.bench import plot
    from kvpush.bench.vllm_bench import BENCH_SERVE

    for mode, engine in (("push", "mono"), ("pull", "decode")):
        subprocess.run(
            [*BENCH_SERVE, "--backend", "openai", "--base-url",
             engines[engine].spec.url, "--model", str(tiny_model), "--served-model-name",
             "tiny", "--dataset-name", "random", "--random-input-len", "32",
             "--random-output-len", "4", "--num-prompts", "3", "--request-rate", "2",
             "--save-result", "--result-dir", str(tmp_path), "--result-filename",
             f"{mode}_qps2_in32_out4_iter0.json"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    assert plot.main(tmp_path) == 0
    assert (tmp_path / "ttft_median.png").stat().st_size > 1000
    summary = (tmp_path / "summary.md").read_text()
    assert "| QPS | input | output | push ms | pull ms | push/pull |" in summary
    assert "| 2 | 32 | 4 |" in summary


def test_sequential_streams_reuse_the_proxys_connections(proxy_url):
    """Requests one after another reuse the proxy's connection to decode. The relay stops at
    decode's [DONE], a write before its stream's chunked end; released then, aiohttp closes the
    connection, and each decode leg used to open one of its own (a TCP connect and accept on the
    engines' cores). Now at most a health check in flight at the same moment needs another."""
    url, _, decode_url = proxy_url
    key = f'kvpush_proxy_engine_connections_opened{{engine="{decode_url}",role="decode"}}'

    async def go():
        async with session() as c:
            await post(c, url, body(tokens(40, seed=300), 4, stream=True))
            before = metric_samples(url)[key]
            for i in range(8):
                await post(c, url, body(tokens(40, seed=301 + i), 4, stream=True))
            return before, metric_samples(url)[key]

    before, after = asyncio.run(go())
    assert after - before <= 2, f"{after - before:.0f} connections opened for 8 requests"
