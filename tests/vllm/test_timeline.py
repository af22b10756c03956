"""The connector's timeline phases: from the endpoints' marks to kvpush:phase_seconds."""

from __future__ import annotations

from kvpush.vllm.stats import PHASE_NAMES, KVPushStats
from kvpush.vllm.worker import PHASES, timeline_phases


def test_the_stats_module_names_every_phase_the_worker_computes():
    assert tuple(PHASES) == PHASE_NAMES


def test_prefill_phases_from_marks_and_missing_marks_skip_their_phase():
    marks = {"finished": 10.0, "started": 10.001, "handed": 10.002, "posted": 10.05}
    phases = timeline_phases(marks | {"written": 10.051, "reported": 10.06})
    assert phases.keys() == {"handover", "next_step", "pair_and_post", "write", "release"}
    assert abs(phases["pair_and_post"] - 0.048) < 1e-9
    # a source that never posted (its lease expired): no post, no write phase
    got = timeline_phases({"finished": 1.0, "started": 1.05, "handed": 1.1, "reported": 31.0})
    assert set(got) == {"handover", "next_step"}


def test_stats_carry_phases_across_ranks():
    a, b = KVPushStats(), KVPushStats()
    a.record(True, 10, 1, 0.01, {"register": 0.001, "wait_writes": 0.02})
    b.record(True, 10, 1, 0.01, {"wait_writes": 0.03})
    merged = a.aggregate(b)
    assert merged.data["phases_s"] == {"register": [0.001], "wait_writes": [0.02, 0.03]}
    assert not merged.is_empty()
