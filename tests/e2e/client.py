"""What the e2e tests send: both legs of a disaggregated request, as a router would, and the
reference answer from a plain engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvpush import httpclient
from tests.servers import metric_samples  # noqa: F401 - re-exported for the e2e tests


def session(max_connections: int = 100) -> aiohttp.ClientSession:
    """The tests' client: kvpush's, with reads bounded at 120 s and connects at 5 s (as the
    proxy's)."""
    return httpclient.session(max_connections, read_timeout_s=120.0, connect_timeout_s=5.0)


@dataclass(frozen=True)
class Pair:
    prefill_url: str
    decode_url: str
    prefill_engine_id: str
    side_channel_port: int


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of `n` random token ids (no special tokens), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


def prefill_params(transfer_id: str) -> dict:
    return {"do_remote_decode": True, "transfer_id": transfer_id}


def decode_params(pair: Pair, transfer_id: str) -> dict:
    return {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_host": "127.0.0.1",
        "remote_port": pair.side_channel_port,
        "remote_engine_id": pair.prefill_engine_id,
        "tp_size": 1,
    }


def body(prompt, max_tokens: int, chat: bool = False, stream: bool = False, **kw) -> dict:
    b = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": stream} | kw
    if chat:
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    return b


async def post(client: aiohttp.ClientSession, url: str, b: dict, chat: bool = False) -> dict:
    """The answer; a status other than 200 raises aiohttp.ClientResponseError."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.post(url + path, json=b) as r:
        if r.status != 200:
            await r.read()
        r.raise_for_status()
        if not b.get("stream"):
            return json.loads(await r.read())
        text = []
        async for event in httpclient.sse_events(r):
            if "error" in event:
                raise RuntimeError(event["error"])
            text.append(httpclient.sse_text(event))
    return {"choices": [{"text": "".join(text)}], "streamed": True}


def text_of(resp: dict) -> str:
    choice = resp["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"]


async def disagg(
    client: aiohttp.ClientSession,
    pair: Pair,
    prompt,
    max_tokens: int = 16,
    chat: bool = False,
    stream: bool = False,
    delay_prefill_s: float = 0.0,
    delay_decode_s: float = 0.0,
    transfer_id: str | None = None,
    prefill_kv: dict | None = None,
    decode_kv: dict | None = None,
    **kw,
) -> dict:
    """Both legs at once (one may be delayed to force an arrival order); decode's answer. As
    the proxy does, a leg that fails cancels the other. `prefill_kv` / `decode_kv`: more
    kv_transfer_params for that leg."""
    tid = transfer_id or uuid.uuid4().hex

    async def prefill_leg():
        await asyncio.sleep(delay_prefill_s)
        params = prefill_params(tid) | (prefill_kv or {})
        b = body(prompt, 1, chat, kv_transfer_params=params, **kw)
        return await post(client, pair.prefill_url, b, chat)

    async def decode_leg():
        await asyncio.sleep(delay_decode_s)
        params = decode_params(pair, tid) | (decode_kv or {})
        b = body(prompt, max_tokens, chat, stream, kv_transfer_params=params, **kw)
        return await post(client, pair.decode_url, b, chat)

    legs = [
        asyncio.ensure_future(labelled("prefill", prefill_leg())),
        asyncio.ensure_future(labelled("decode", decode_leg())),
    ]
    try:
        _, out = await asyncio.gather(*legs)
    except Exception:
        for leg in legs:
            leg.cancel()
        await asyncio.wait(legs)
        raise
    return out


async def labelled(leg: str, coro):
    """Await `coro`; an exception it raises carries a note naming the leg, how long it ran and
    the low-level cause (a reset connection, a local close), for a failing test to print."""
    start = time.monotonic()
    try:
        return await coro
    except Exception as e:
        cause = e.__cause__ or e.__context__
        e.add_note(f"{leg} leg, after {time.monotonic() - start:.2f} s, cause {cause!r}")
        raise


def describe(e: BaseException) -> str:
    """`repr(e)` with its notes."""
    notes = getattr(e, "__notes__", ())
    return f"{e!r}" + (f" [{'; '.join(notes)}]" if notes else "")


_TCP_COUNTERS = (
    "ListenOverflows",
    "ListenDrops",
    "TCPSynRetrans",
    "TCPTimeouts",
    "RetransSegs",
    "TCPAbortOnData",
    "EstabResets",
)


def tcp_counters() -> dict[str, int]:
    """This host's TCP counters that a lost or reset connection moves (/proc/net/netstat and
    /proc/net/snmp)."""
    found: dict[str, int] = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            for name, value in zip(names.split()[1:], values.split()[1:], strict=False):
                if name in _TCP_COUNTERS:
                    found[name] = int(value)
    return found


async def plain(client, url, prompt, max_tokens: int = 16, chat=False, stream=False, **kw):
    return await post(client, url, body(prompt, max_tokens, chat, stream, **kw), chat)


def kv_usage(url: str) -> float:
    return metric_samples(url)["vllm:kv_cache_usage_perc"]


def wait_usage_zero(*urls: str, timeout_s: float) -> float:
    """Poll until every engine's KV-cache usage is exactly 0.0; the seconds it took."""
    start = time.monotonic()
    while True:
        usage = {u: kv_usage(u) for u in urls}
        if all(v == 0.0 for v in usage.values()):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"KV cache not released within {timeout_s} s: {usage}")
        time.sleep(0.1)


def kvpush_gauges(url: str) -> dict[str, float]:
    """kvpush's gauges as an engine's /metrics shows them (absent before the first transfer)."""
    from kvpush.vllm.stats import GAUGES

    samples = metric_samples(url)
    return {name: samples[f"kvpush:{name}"] for name in GAUGES if f"kvpush:{name}" in samples}


def wait_idle(*urls: str, timeout_s: float, step_stale: bool = False) -> float:
    """KV-cache usage exactly 0.0 and every kvpush gauge 0 on each engine.

    Gauges move only with an engine step, and one change can land on an idle engine (a
    registration for a request prefill never saw, ended by its lease: docs/design/transfer.md,
    Gauges). With `step_stale`, for a test that only needs to start from idle engines, an
    engine whose gauges stay up once its KV usage is 0 gets a 1-token request, one step;
    a gauge still up after that is held for real."""
    took = wait_usage_zero(*urls, timeout_s=timeout_s)
    start = stepped = time.monotonic()
    while True:
        held = {u: {k: v for k, v in kvpush_gauges(u).items() if v} for u in urls}
        if not any(held.values()):
            return took
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"kvpush gauges not 0 within {timeout_s} s: {held}")
        if step_stale and time.monotonic() - stepped > 2.0:
            for url in (u for u, h in held.items() if h):
                post_sync(url, body([5], 1))
            stepped = time.monotonic()
        time.sleep(0.1)


def post_sync(url: str, b: dict, path: str = "/v1/completions") -> dict:
    """One blocking request, for a test's set-up; a status other than 200 raises."""
    request = urllib.request.Request(
        url + path, json.dumps(b).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


async def abort_after(coro, seconds: float) -> None:
    """Run a request and drop its connection after `seconds`, as a client that goes away."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(seconds)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
        await task


def kvpush_warnings(*log_paths, last: int = 10, ignore: str = "cancelled by decode") -> str:
    """The last kvpush warnings in engine logs (but the expected ones): what a failed
    assertion should show."""
    out = []
    for path in log_paths:
        lines = path.read_text(errors="replace").splitlines()
        lines = [ln for ln in lines if "WARNING" in ln and "kvpush" in ln and ignore not in ln]
        out += [f"{path.name}: {ln[:300]}" for ln in lines[-last:]]
    return "\n".join(out)


NEAR_TIE = 1e-3  # top-2 log-probability gap below which greedy decoding may go either way


async def reference_and_disagg(pair: Pair, mono_url: str, prompts: list, max_tokens: int):
    """Each prompt through the plain engine one at a time, then all at once through the pair;
    with top-2 log-probabilities, for `assert_same_or_near_tie`."""
    async with session() as c:
        wants = [await plain(c, mono_url, p, max_tokens, logprobs=2) for p in prompts]
        gots = await asyncio.gather(*(disagg(c, pair, p, max_tokens, logprobs=2) for p in prompts))
    return wants, gots


def assert_same_or_near_tie(want: dict, got: dict) -> None:
    """Greedy outputs equal, or the first difference is at a near-tie of the reference."""
    w, g = want["choices"][0]["logprobs"], got["choices"][0]["logprobs"]
    if g["tokens"] == w["tokens"]:
        return
    pairs = enumerate(zip(w["tokens"], g["tokens"], strict=False))
    i = next(i for i, (a, b) in pairs if a != b)
    top2 = sorted(w["top_logprobs"][i].values(), reverse=True)[:2]
    assert top2[0] - top2[1] < NEAR_TIE, (
        f"outputs differ at token {i} where the reference is no near-tie: {top2}"
    )
