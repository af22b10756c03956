"""Fresh prompts: no prompt, and no prompt's head, repeats anywhere in a run."""

from __future__ import annotations

import pytest

from kvpush.bench.prompts import HEAD_TOKENS, PromptSource, SharedPrefix
from kvpush.bench.serve import point_key, rounds, warm_up_key


@pytest.fixture(scope="module")
def source(tiny_model):
    return PromptSource(str(tiny_model), seed=7)


def test_no_prompt_repeats_across_points_rounds_and_warm_ups(source):
    """Every set a two-round run over two stacks asks for (keys as `sweep` makes them): each
    prompt of the exact length, and no two sharing their first HEAD_TOKENS tokens."""
    qps, lens, iterations = (1.0, 2.0), (64, 128), 2
    sets = []
    for _mode, first in rounds(["kvpush", "replicas"], 2, iterations):
        for n_in in lens:
            key = warm_up_key(first, n_in)
            sets.append((key, source.prompts(key, 3, n_in), n_in))
        for it in range(first, first + iterations):
            for q in qps:
                for n_in in lens:
                    key = point_key(it, q, n_in, 4)
                    sets.append((key, source.prompts(key, 6, n_in), n_in))
    # the second stack of a round gets the first's prompts (its own fresh engines)...
    assert len({key for key, _, _ in sets}) == len(sets) // 2
    unique = {key: (made, n) for key, made, n in sets}
    heads, texts = set(), set()
    for made, n_in in unique.values():
        for text in made:
            tokens = source.tokenizer(text).input_ids
            assert len(tokens) == n_in
            heads.add(tuple(tokens[:HEAD_TOKENS]))
            texts.add(text)
    # ...and every set of the run is new: 4 warm-up sets of 3, 16 point sets of 6
    assert len(texts) == len(heads) == 4 * 3 + 16 * 6


def test_a_seed_gives_the_same_prompts_and_another_seed_new_ones(tiny_model, source):
    key = point_key(100, 1.0, 64, 4)  # a set the other tests do not ask for
    again = PromptSource(str(tiny_model), seed=7).prompts(key, 3, 64)
    assert again == source.prompts(key, 3, 64)
    other = PromptSource(str(tiny_model), seed=8).prompts(key, 3, 64)
    assert not set(other) & set(again)


def test_a_set_asked_for_again_with_other_lengths_is_refused(source):
    key = point_key(9, 1.0, 64, 4)
    source.prompts(key, 2, 64)
    with pytest.raises(ValueError, match="other lengths"):
        source.prompts(key, 3, 64)
    with pytest.raises(ValueError, match="input_len must be >= 16"):
        source.prompts(point_key(9, 1.0, 8, 4), 1, 8)


def test_the_custom_dataset_file_holds_one_prompt_a_line(tmp_path, source):
    import json

    path = source.write(tmp_path, point_key(101, 1.0, 64, 4), 4, 64)
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(x)["prompt"] for x in lines)


def test_shared_prefix_prompts_share_their_groups_prefix_and_nothing_else(tiny_model):
    """`--shared-prefix 64 --num-prefixes 2`: each prompt of the exact length opens with one
    of its set's two prefixes (in shuffled order), the rest fresh; another set's prefixes
    are other ones; the same seed gives the same prompts."""
    shared = SharedPrefix(prefix_len=64, num_prefixes=2)
    source = PromptSource(str(tiny_model), seed=11, shared=shared)
    made = source.prompts(("point", 1), 6, 128)
    ids = [source.tokenizer(t).input_ids for t in made]
    assert all(len(t) == 128 for t in ids)
    # blocks of 32 tokens: the first block of the prefix is what an engine's cache matches
    groups = {tuple(t[:32]) for t in ids}
    assert len(groups) == 2
    assert len({tuple(t[96:]) for t in ids}) == 6  # the suffixes all differ
    other = source.prompts(("point", 2), 6, 128)
    assert not groups & {tuple(source.tokenizer(t).input_ids[:32]) for t in other}
    again = PromptSource(str(tiny_model), seed=11, shared=shared).prompts(("point", 1), 6, 128)
    assert again == made


def test_a_shared_prefix_must_fit_the_prompt(tiny_model):
    with pytest.raises(ValueError, match="shared prefix"):
        SharedPrefix(prefix_len=4, num_prefixes=1)
    source = PromptSource(str(tiny_model), seed=1, shared=SharedPrefix(64, 1))
    with pytest.raises(ValueError, match="must be < 64"):
        source.prompts(("k",), 2, 64)
