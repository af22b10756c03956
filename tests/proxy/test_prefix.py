"""Prefix-aware routing's index (kvpush.proxy.prefix): chained block hashes, a prompt's match
on an engine, and the bound. tests/e2e/test_paths.py routes on real engines by it and reads the
engine's own prefix-cache hits."""

from __future__ import annotations

import pytest

from kvpush.proxy.prefix import BLOCK_CHARS, BLOCK_TOKENS, PrefixIndex, block_hashes


def test_blocks_are_chained_so_a_block_matches_only_under_the_same_prefix():
    a = block_hashes({"prompt": list(range(100))}, chat=False)
    assert len(a) == 100 // BLOCK_TOKENS  # the partial last block is left out
    b = block_hashes({"prompt": [999, *range(1, 100)]}, chat=False)
    assert not set(a) & set(b)  # one token differs in the first block: nothing matches
    same_head = block_hashes({"prompt": list(range(64)) + [7] * 40}, chat=False)
    assert same_head[:2] == a[:2] and same_head[2] != a[2]


def test_text_and_chat_prompts_are_cut_by_characters():
    text = "x" * (3 * BLOCK_CHARS + 5)
    assert len(block_hashes({"prompt": text}, chat=False)) == 3
    chat = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}
    other = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "yo"}]}
    assert block_hashes(chat, chat=True)[:3] == block_hashes(other, chat=True)[:3]
    assert block_hashes({"prompt": ["a", "b"]}, chat=False) == ()  # a batch: not routed by it


def test_a_match_is_the_run_of_leading_blocks_held_and_the_oldest_go_first():
    index = PrefixIndex(capacity_blocks=4)
    a = block_hashes({"prompt": list(range(4 * BLOCK_TOKENS))}, chat=False)
    index.add(a[:3])
    assert index.match_tokens(a) == 3 * BLOCK_TOKENS
    index.add(block_hashes({"prompt": list(range(5000, 5000 + 2 * BLOCK_TOKENS))}, chat=False))
    assert len(index) == 4 and index.match_tokens(a) == 0  # a's first block was the oldest
    with pytest.raises(ValueError):
        PrefixIndex(capacity_blocks=0)
