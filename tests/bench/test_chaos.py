"""`kvpush bench chaos`'s checks of each stream and its settings, without a stack (the soak
itself runs real engines for minutes: not in `make test`; its result is in the results
page)."""

from __future__ import annotations

import pytest

from kvpush.bench.chaos import ChaosConfig, Outcome, check_stream


def stream(token_ids: list[int], completion_tokens: int, *, rid: str = "cmpl-1") -> list:
    events: list = [
        {"id": rid, "choices": [{"index": 0, "text": "x", "token_ids": [t]}]} for t in token_ids
    ]
    events.append({"id": rid, "choices": [], "usage": {"completion_tokens": completion_tokens}})
    return [*events, "[DONE]"]


def test_a_whole_stream_is_ok_and_gives_its_tokens():
    out = Outcome("r", [1, 2], 3)
    assert check_stream(stream([7, 8, 9], 3), out) == "ok" and out.token_ids == [7, 8, 9]


@pytest.mark.parametrize(
    "events, why",
    [
        (stream([7, 8, 9], 3)[:-1], "no [DONE]"),
        (stream([7], 1)[:-1] + [{"error": {"message": "boom"}}, "[DONE]"], "error event: boom"),
        (stream([7, 8], 2), "2 tokens"),
        (stream([7, 8, 9], 3)[:1] + stream([8, 9], 3, rid="cmpl-2"), "more than one id"),
    ],
    ids=["unended", "error-event", "short", "two-ids"],
)
def test_a_stream_that_is_not_whole_says_what_is_wrong(events, why):
    assert check_stream(events, Outcome("r", [1], 3)).startswith(why)


@pytest.mark.parametrize(
    "bad",
    [{"qps": 0}, {"num_decode": 0}, {"kill_every_s": -1}, {"min_input_len": 9, "max_input_len": 8}],
)
def test_bad_settings_are_refused_by_name(bad):
    with pytest.raises(ValueError):
        ChaosConfig(**bad)
