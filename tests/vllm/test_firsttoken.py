"""FirstTokenProcessor on its own: only the token prefill sampled stays possible, only at a
kvpush-loaded request's first sampled position. (The e2e tests check it inside real engines.)"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from kvpush.vllm import firsttoken
from kvpush.vllm.firsttoken import FirstTokenProcessor


def params(transfer_id: str | None) -> SamplingParams:
    kv = {"do_remote_prefill": True, "transfer_id": transfer_id} if transfer_id else None
    return SamplingParams(temperature=1.0, extra_args={"kv_transfer_params": kv} if kv else None)


def test_forces_prefills_token_once_and_leaves_other_rows_alone():
    proc = FirstTokenProcessor(None, torch.device("cpu"), False)
    out_a: list[int] = []
    out_b: list[int] = []
    firsttoken.offer("t-a", 7)
    added = [(0, params("t-a"), [1, 2], out_a), (1, params(None), [3], out_b)]
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=added, moved=[]))
    logits = torch.randn(2, 16)
    before = logits.clone()
    proc.apply(logits)
    assert torch.isfinite(logits[0]).sum() == 1 and logits[0, 7] == before[0, 7]
    assert torch.equal(logits[1], before[1])
    out_a.append(7)  # vLLM appended the sampled token
    proc.update_state(None)
    logits = torch.randn(2, 16)
    before = logits.clone()
    proc.apply(logits)
    assert torch.equal(logits, before)
    assert "t-a" not in firsttoken._tokens


def test_without_a_token_decode_samples_its_own():
    proc = FirstTokenProcessor(None, torch.device("cpu"), False)
    added = [(0, params("t-none"), [1], [])]
    proc.update_state(BatchUpdate(batch_size=1, removed=[], added=added, moved=[]))
    logits = torch.randn(1, 16)
    before = logits.clone()
    proc.apply(logits)
    assert torch.equal(logits, before)


def test_follows_moves_in_the_batch():
    proc = FirstTokenProcessor(None, torch.device("cpu"), False)
    firsttoken.offer("t-m", 3)
    added = [(0, params("t-m"), [1], [])]
    proc.update_state(BatchUpdate(batch_size=1, removed=[], added=added, moved=[]))
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality

    moved = [(0, 2, MoveDirectionality.UNIDIRECTIONAL)]
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=moved))
    logits = torch.randn(3, 8)
    proc.apply(logits)
    assert torch.isfinite(logits[2]).sum() == 1 and torch.isfinite(logits[0]).all()
