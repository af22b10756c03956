from __future__ import annotations

from kvpush.bench.plot import NAME
from kvpush.bench.serve import path_counts, result_name, rounds


def test_rounds_bring_the_stacks_up_in_turn_with_iterations_of_their_own():
    """`--rounds 3` over two stacks at two iterations each: a, b, a, b, a, b, and every
    result file of a mode gets its own iteration number, so none overwrites another."""
    order = rounds(["kvpush", "mono"], 3, 2)
    assert order == [("kvpush", 0), ("mono", 0), ("kvpush", 2), ("mono", 2), ("kvpush", 4),
                     ("mono", 4)]  # fmt: skip
    names = {result_name(m, 1.0, 256, 16, first + i) for m, first in order for i in range(2)}
    assert len(names) == 12
    assert all(NAME.match(n) for n in names)
    assert rounds(["mono"], 1, 1) == [("mono", 0)]


def test_the_paths_taken_are_counted_from_the_timelines_and_absent_for_a_plain_engine():
    timelines = [{"path": "push"}, {"path": "local"}, {"path": "push"}, {"path": ""}, {}]
    assert path_counts(timelines) == {"push": 2, "local": 1}
    assert path_counts(None) is None
