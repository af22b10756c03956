"""How kvpush reads vLLM's per-layer KV-cache views on a GPU, without a GPU: the views are
built on PyTorch's meta device exactly as vLLM builds them (`create_kv_cache_views`: one
int8 buffer, [B, H, N, C] per layer, viewed as the cache dtype), layer-outer (HND, what
kvpush asks for) and block-outer (BLHNC, cross-layer)."""

from __future__ import annotations

import pytest
import torch

from kvpush.transfer.layout import plan_copies
from kvpush.vllm.kvlayout import layout_from_kv_caches

LAYERS, BLOCKS, HEADS, TOKENS, DIM = 3, 8, 2, 16, 64
PAGE = HEADS * TOKENS * 2 * DIM * 2  # bytes: bf16 K and V of every head and token of a block


def views(block_outer: bool) -> dict[str, torch.Tensor]:
    raw = torch.empty(LAYERS * BLOCKS * PAGE, dtype=torch.int8, device="meta")
    block_stride = LAYERS * PAGE if block_outer else PAGE
    out = {}
    for layer in range(LAYERS):
        offset = layer * PAGE if block_outer else layer * BLOCKS * PAGE
        row = 2 * DIM * 2  # one token of one head: K then V
        view = torch.as_strided(
            raw, (BLOCKS, HEADS, TOKENS, row), (block_stride, TOKENS * row, row, 1), offset
        )
        out[f"model.layers.{layer}.self_attn.attn"] = view.view(torch.bfloat16)
    return out


@pytest.mark.parametrize("block_outer", [False, True])
def test_gpu_views_read_as_head_major_blocks_with_k_and_v_one_vector(block_outer):
    layout = layout_from_kv_caches(views(block_outer), TOKENS, HEADS, tp_rank=0, tp_size=1)
    assert (layout.mem_type, layout.head_major, layout.num_parts) == ("VRAM", True, 1)
    assert layout.head_bytes == 2 * DIM * 2 and layout.block_bytes == PAGE
    assert len(layout.regions) == LAYERS and layout.num_blocks == BLOCKS
    stride = LAYERS * PAGE if block_outer else PAGE
    assert {r.block_stride_bytes for r in layout.regions} == {stride}
    assert layout.tiles_blocks == block_outer
    # a run of 4 whole blocks: one descriptor per layer, or one for all layers
    plan = plan_copies(layout, layout, [0, 1, 2, 3], [4, 5, 6, 7], 0, 4 * TOKENS)
    assert plan.num_descs == (1 if block_outer else LAYERS)
    assert plan.total_bytes == 4 * PAGE * LAYERS


def test_gpu_views_in_token_major_order_are_refused():
    """LBNHC (NHD) views are [B, H, N, C] over memory ordered [B, N, H, C]: not read."""
    raw = torch.empty(BLOCKS * PAGE, dtype=torch.int8, device="meta")
    row = 2 * DIM * 2
    nhd = torch.as_strided(raw, (BLOCKS, HEADS, TOKENS, row), (PAGE, row, HEADS * row, 1))
    with pytest.raises(ValueError, match="not contiguous"):
        layout_from_kv_caches({"l0": nhd.view(torch.bfloat16)}, TOKENS, HEADS, 0, 1)
