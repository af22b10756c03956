"""Prefix-aware routing: how much of a prompt an engine likely holds in its prefix cache.

The proxy cannot see the engines' caches; it remembers what it sent where, as SGLang's router
and llm-d's approximate prefix scorer do. A prompt is cut into blocks, each block's hash chained
to the one before it (as vLLM chains its block hashes), so that a block matches only under the
same whole prefix. An engine's index holds the hashes of the prompt blocks it computed lately,
bounded (the oldest go first, as an engine's cache evicts its least recently used blocks). A
prompt's match on an engine is its longest run of leading blocks found in that engine's index,
in estimated tokens; the dispatcher counts only the rest as the prompt's work there
(kvpush.proxy.paths).

Token-id prompts are cut every `BLOCK_TOKENS` ids; text every `BLOCK_CHARS` characters (about as
many tokens, at the dispatcher's four characters a token). The estimate can be wrong both ways:
an engine may have evicted a block, and text blocks do not fall on the engine's token blocks.
A wrong guess costs only an engine choice, never an answer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

BLOCK_TOKENS = 32
CHARS_PER_TOKEN = 4  # as dispatch.estimate_prompt_tokens
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
DEFAULT_CAPACITY_BLOCKS = 131_072  # per engine: 4M tokens at 32 a block, past any CPU cache


def block_hashes(body: dict, chat: bool) -> tuple[int, ...]:
    """The chained hashes of a request's prompt blocks (the last, partial block left out: an
    engine caches only full blocks). Empty for a prompt it cannot read (a list of prompts)."""
    prompt: Any
    if chat:
        messages = body.get("messages") or []
        prompt = "".join(
            f"{m.get('role', '')}\x00{m.get('content', '')}\x01"
            for m in messages
            if isinstance(m, dict)
        )
    else:
        prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        size = BLOCK_TOKENS
    elif isinstance(prompt, str):
        size = BLOCK_CHARS
    else:
        return ()
    hashes, prev = [], 0
    for start in range(0, len(prompt) - size + 1, size):
        prev = hash((prev, tuple(prompt[start : start + size])))
        hashes.append(prev)
    return tuple(hashes)


class PrefixIndex:
    """The prompt blocks an engine computed lately, least recently used first."""

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match_tokens(self, hashes: tuple[int, ...]) -> int:
        """Estimated prompt tokens this engine holds: its run of leading blocks, in tokens."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n * BLOCK_TOKENS

    def add(self, hashes: tuple[int, ...]) -> None:
        """The engine computed (or was pushed) these blocks: most recently used now."""
        blocks = self._blocks
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
