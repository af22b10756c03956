"""Decode continues from prefill's first token instead of sampling its own.

The proxy streams prefill's first token to the client as soon as prefill answers. Decode then
recomputes the last prompt position and samples again; under random sampling that second draw
could differ from what the client already has. So prefill's token travels with the KV: the
prefill connector puts it in every WRITE's notification, the decode worker offers it here when
the load completes, and `FirstTokenProcessor`, a vLLM logits processor loaded on decode
engines (`--logits-processors kvpush.vllm.firsttoken:FirstTokenProcessor`, which `kvpush serve`
adds), leaves only that token possible at the request's first sampled position. Every other
logit becomes -inf before penalties, temperature, top-k/top-p and min-p, so whatever the
sampling parameters, the sampler can only pick it.

The processor runs in the same process as the connector's worker half (each TP rank has its
own), after that worker reported the load finished, so a plain dict carries the token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:  # vLLM's types, for the checker only
    from vllm.config import ModelConfig, VllmConfig

FQCN = "kvpush.vllm.firsttoken:FirstTokenProcessor"
_MAX_TOKENS = 65_536  # tokens of loads whose request never sampled (aborted): the oldest go

_tokens: OrderedDict[str, int] = OrderedDict()  # transfer_id -> prefill's first token


def offer(transfer_id: str, token: int) -> None:
    """The decode worker: `transfer_id`'s KV is in, and prefill sampled `token` first."""
    _tokens[transfer_id] = token
    if len(_tokens) > _MAX_TOKENS:
        _tokens.popitem(last=False)


def pending() -> int:
    return len(_tokens)


def is_loaded(model_config: ModelConfig) -> bool:
    """Whether vLLM was told to load FirstTokenProcessor (by name or as the class)."""
    return any(p in (FQCN, FirstTokenProcessor) for p in model_config.logits_processors or ())


class FirstTokenProcessor(LogitsProcessor):
    """Forces prefill's first token for requests loaded by kvpush; a no-op for the rest."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # batch index -> (transfer_id, the request's output token ids: vLLM's live list)
        self._waiting: dict[int, tuple[str, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._waiting, batch_update, _transfer_of)
        for index, (transfer_id, output) in list(self._waiting.items()):
            if output:  # its first token is sampled: done with it
                del self._waiting[index]
                _tokens.pop(transfer_id, None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (transfer_id, _) in self._waiting.items():
            token = _tokens.get(transfer_id)
            if token is None or not 0 <= token < logits.shape[1]:
                continue  # no token came with the KV: decode samples its own
            row = logits[index]
            keep = row[token].clone()
            row.fill_(float("-inf"))
            row[token] = keep if torch.isfinite(keep) else 0.0
        return logits


def _transfer_of(params: Any, prompt: list[int] | None, output: list[int]) -> Any:
    """(transfer_id, output) for a request decode loads from a kvpush prefill, else None."""
    if output:
        return None
    kv = (params.extra_args or {}).get("kv_transfer_params")
    if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
        return None
    transfer_id = kv.get("transfer_id")
    return (transfer_id, output) if isinstance(transfer_id, str) else None
