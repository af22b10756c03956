"""Fresh prompts for a benchmark run: no engine of the run has seen any of them before.

vLLM's `random` dataset builds each prompt as a run of consecutive token ids from a random
offset, so two prompts whose offsets meet share everything from their first block on: with a
4,096-token vocabulary a few hundred prompts already hold dozens of such pairs. Its seeds were
also the same at every invocation, so a second run against a live engine measured its prefix
cache. Here every prompt is drawn token by token at random, seeded from the run's seed and the
prompt set's key, and the run refuses a prompt whose head (its first `HEAD_TOKENS` tokens,
under any engine's block size) it has handed out before under another key. One key always gives
the same prompts, so each stack of a run gets the same prompts on its own fresh engines.

The prompts go to `vllm bench serve` as its `custom` dataset (a JSONL file), so its
definitions of TTFT, TPOT and ITL still apply; lengths are exact, as vLLM's random dataset
makes them (decoded, re-encoded, trimmed: `gen_prompt_decode_to_target_len`).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HEAD_TOKENS = 16  # smaller than any block size an engine uses, so a shared head is a cache hit
MAX_DRAWS = 50  # per prompt: a tokenizer that cannot give the exact length fails loudly


def new_seed() -> int:
    """A run seed for when none is given: every invocation then sends new prompts."""
    return secrets.randbelow(2**31)


@dataclass(frozen=True)
class SharedPrefix:
    """Prompts in `num_prefixes` groups, each group's prompts opening with the same
    `prefix_len` tokens (a system prompt, a shared document, a conversation so far), the rest
    fresh; the groups' order shuffled. The prefixes are fresh too: new to every engine."""

    prefix_len: int
    num_prefixes: int

    def __post_init__(self) -> None:
        if self.prefix_len < HEAD_TOKENS or self.num_prefixes < 1:
            raise ValueError(
                f"a shared prefix needs >= {HEAD_TOKENS} tokens and >= 1 prefix, got {self}"
            )


class PromptSource:
    """Prompt sets for one run, each named by a key (a tuple of str, int and float)."""

    def __init__(self, tokenizer: str, seed: int, shared: SharedPrefix | None = None) -> None:
        from transformers import AutoTokenizer

        self.seed, self.shared = seed, shared
        self.tokenizer: Any = AutoTokenizer.from_pretrained(tokenizer)
        special = set(self.tokenizer.all_special_ids)
        self._allowed = np.array([t for t in range(self.tokenizer.vocab_size) if t not in special])
        self._sets: dict[tuple, list[str]] = {}
        self._heads: dict[tuple[int, ...], tuple] = {}  # head -> the key that used it

    def prompts(self, key: tuple, num_prompts: int, input_len: int) -> list[str]:
        """`num_prompts` prompts of exactly `input_len` tokens, the same for the same key."""
        if key in self._sets:
            made = self._sets[key]
            if len(made) != num_prompts or self.num_tokens(made[0]) != input_len:
                raise ValueError(f"prompt set {key} was made with other lengths")
            return made
        if input_len < HEAD_TOKENS:
            raise ValueError(f"input_len must be >= {HEAD_TOKENS} tokens, got {input_len}")
        rng = np.random.default_rng(self._entropy(key))
        shared = self.shared
        if shared is not None and shared.prefix_len >= input_len:
            raise ValueError(f"the shared prefix ({shared.prefix_len}) must be < {input_len}")
        prefixes: list[list[int]] = []
        if shared is not None:  # each prefix's head new to the run; its prompts share it
            prefixes = [
                self._draw(rng, key, shared.prefix_len)[1] for _ in range(shared.num_prefixes)
            ]
        made = []
        for i in range(num_prompts):
            prefix = prefixes[i % len(prefixes)] if prefixes else []
            made.append(self._draw(rng, key, input_len, prefix)[0])
        if prefixes:
            made = [made[i] for i in rng.permutation(len(made))]
        self._sets[key] = made
        return made

    def _draw(
        self, rng: np.random.Generator, key: tuple, length: int, prefix: list[int] | None = None
    ) -> tuple[str, list[int]]:
        """A prompt of exactly `length` tokens (text and ids), opening with `prefix`; without
        one, its head new to the run."""
        from vllm.benchmarks.datasets import gen_prompt_decode_to_target_len

        prefix = prefix or []
        for _ in range(MAX_DRAWS):
            drawn = self._allowed[rng.integers(0, len(self._allowed), length - len(prefix))]
            text, _, _ = gen_prompt_decode_to_target_len(
                self.tokenizer, prefix + drawn.tolist(), length, add_special_tokens=False, rng=rng
            )
            tokens = self.tokenizer(text).input_ids
            head = tuple(tokens[:HEAD_TOKENS])
            if len(tokens) == length and (prefix or head not in self._heads):
                if not prefix:
                    self._heads[head] = key
                return text, tokens
        raise RuntimeError(
            f"no fresh prompt of exactly {length} tokens in {MAX_DRAWS} draws (set {key}): "
            "the tokenizer cannot hit that length"
        )

    def write(self, folder: Path, key: tuple, num_prompts: int, input_len: int) -> Path:
        """The set as `vllm bench serve`'s custom dataset (JSONL, one `prompt` a line)."""
        prompts = self.prompts(key, num_prompts, input_len)
        name = "prompts-" + hashlib.sha256(repr((self.seed, key)).encode()).hexdigest()[:12]
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        return path

    def num_tokens(self, text: str) -> int:
        return len(self.tokenizer(text).input_ids)

    def _entropy(self, key: tuple) -> list[int]:
        digest = hashlib.sha256(repr(key).encode()).digest()
        return [self.seed, *np.frombuffer(digest, dtype=np.uint32).tolist()]
