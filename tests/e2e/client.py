"""What the e2e tests send: both legs of a disaggregated request, as a router would, and the
reference answer from a plain engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpush.httpclient import async_client

TIMEOUT = httpx.Timeout(120.0, connect=5.0)  # connect as the proxy does (connect_timeout_s)


@dataclass(frozen=True)
class Pair:
    prefill_url: str
    decode_url: str
    prefill_engine_id: str
    side_channel_port: int


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


async def post(client: httpx.AsyncClient, url: str, b: dict, chat: bool = False) -> dict:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not b.get("stream"):
        r = await client.post(url + path, json=b, timeout=TIMEOUT)
        r.raise_for_status()
        return r.json()
    text, ids = [], []
    async with client.stream("POST", url + path, json=b, timeout=TIMEOUT) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for choice in event.get("choices", []):
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return {"choices": [{"text": "".join(text)}], "streamed": True, "token_ids": ids}


def text_of(resp: dict) -> str:
    choice = resp["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"]


async def disagg(
    client: httpx.AsyncClient,
    pair: Pair,
    prompt,
    max_tokens: int = 16,
    chat: bool = False,
    stream: bool = False,
    delay_prefill_s: float = 0.0,
    delay_decode_s: float = 0.0,
    transfer_id: str | None = None,
    **kw,
) -> dict:
    """Both legs at once (one may be delayed to force an arrival order); decode's answer. As
    the proxy does, a leg that fails cancels the other."""
    tid = transfer_id or uuid.uuid4().hex

    async def prefill_leg():
        await asyncio.sleep(delay_prefill_s)
        b = body(prompt, 1, chat, kv_transfer_params=prefill_params(tid), **kw)
        return await post(client, pair.prefill_url, b, chat)

    async def decode_leg():
        await asyncio.sleep(delay_decode_s)
        b = body(
            prompt, max_tokens, chat, stream, kv_transfer_params=decode_params(pair, tid), **kw
        )
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


_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.M)


def kv_usage(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(_USAGE.search(text).group(1))


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


_KVPUSH = re.compile(r"^kvpush:(\w+)\{[^}]*\} (\S+)$", re.M)


def kvpush_gauges(url: str) -> dict[str, float]:
    """kvpush's gauges as an engine's /metrics shows them (absent before the first transfer)."""
    from kvpush.vllm.stats import GAUGES

    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: float(v) for name, v in _KVPUSH.findall(text) if name in GAUGES}


def wait_idle(*urls: str, timeout_s: float, step_stale: bool = False) -> float:
    """KV-cache usage exactly 0.0 and every kvpush gauge 0 on each engine.

    Gauges move only with an engine step, and one change can land on an idle engine (a
    registration for a request prefill never saw, ended by its lease: docs/architecture.md,
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
                httpx.post(
                    url + "/v1/completions", json=body([5], 1), timeout=30
                ).raise_for_status()
            stepped = time.monotonic()
        time.sleep(0.1)


async def abort_after(coro, seconds: float) -> None:
    """Run a request and drop its connection after `seconds`, as a client that goes away."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(seconds)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
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
    async with async_client() as c:
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
