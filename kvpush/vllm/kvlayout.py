"""Describe vLLM's KV-cache tensors as a kvpush KVLayout."""

from __future__ import annotations

from typing import Any

from kvpush.transfer.layout import KVLayout, RegionSpec, rank_heads


def layout_from_kv_caches(
    kv_caches: dict[str, Any], block_size: int, total_heads: int, tp_rank: int, tp_size: int
) -> KVLayout:
    """One region per layer (two where K and V are separate tensors).

    Supported shapes, per layer:
    - [blocks, heads, block_size, 2 * head_dim] on CPU: vLLM's CPU backend; each head holds
      its K as [dim][token], then its V as [token][dim] (head-major, two parts; checked at
      start-up by `probe_cpu_layout`);
    - [blocks, heads, block_size, 2 * head_dim] on a GPU: vLLM's per-layer views of the HND
      (LBHNC) layout, each token of a head its K then its V (FlashAttention splits the last
      dimension so); head-major, K and V one vector. The block stride is the view's, so a
      block-outer (cross-layer) buffer is read as such (KVLayout.tiles_blocks);
    - [2, blocks, heads, block_size, head_dim]: K and V apart, head-major (HND; older vLLM);
    - [2, blocks, block_size, heads, head_dim]: K and V apart, token-major (NHD).
    """
    tensors = list(kv_caches.values())
    if not tensors:
        raise ValueError("vLLM registered no KV-cache tensors")
    first = tensors[0]
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"layer {name} has KV cache {tuple(t.shape)} {t.dtype}, "
                f"unlike {tuple(first.shape)} {first.dtype}"
            )
    inner = first[0][0] if first.dim() == 5 else first[0]
    if not inner.is_contiguous():
        raise ValueError(f"KV cache blocks are not contiguous (strides {first.stride()})")
    size = first.element_size()
    heads = rank_heads(tp_rank, tp_size, total_heads)
    on_cpu = first.device.type == "cpu"
    mem_type = "DRAM" if on_cpu else "VRAM"
    dev_id = first.device.index or 0
    shape = tuple(first.shape)
    dim_major_parts: tuple[int, ...]
    if len(shape) == 4 and shape[1] == len(heads) and shape[2] == block_size:
        num_blocks, _, _, content = shape
        regions = [RegionSpec(t.data_ptr(), t.stride(0) * size) for t in tensors]
        head_major = True
        if on_cpu:
            probe_cpu_layout(first.dtype, block_size, content // 2)
            head_bytes, num_parts, dim_major_parts = content // 2 * size, 2, (0,)
        else:
            head_bytes, num_parts, dim_major_parts = content * size, 1, ()
    elif len(shape) == 5 and shape[0] == 2:
        _, num_blocks, a, b, head_dim = shape
        head_major = (a, b) == (len(heads), block_size)
        if not head_major and (a, b) != (block_size, len(heads)):
            raise ValueError(f"unsupported KV cache shape {shape}")
        regions = [RegionSpec(t[i].data_ptr(), t.stride(1) * size) for t in tensors for i in (0, 1)]
        head_bytes, num_parts, dim_major_parts = head_dim * size, 1, ()
    else:
        raise ValueError(
            f"unsupported KV cache shape {shape} (block size {block_size}, {len(heads)} KV "
            "heads on this rank); supported: [B, H, N, 2D], [2, B, H, N, D], [2, B, N, H, D]"
        )
    return KVLayout(
        tuple(regions),
        num_blocks,
        block_size,
        len(heads),
        head_bytes,
        head_major,
        first_head=heads.start,
        total_heads=total_heads,
        mem_type=mem_type,
        dev_id=dev_id,
        num_parts=num_parts,
        dim_major_parts=dim_major_parts,
        elem_bytes=size,
    )


def layer_regions(kv_caches: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each layer's regions in `layout_from_kv_caches`'s layout: one per layer, or two (K,
    then V) where the tensor holds them apart ([2, ...])."""
    names = list(kv_caches)
    per = 2 if names and kv_caches[names[0]].dim() == 5 else 1
    return {name: tuple(range(i * per, (i + 1) * per)) for i, name in enumerate(names)}


def probe_cpu_layout(dtype: Any, block_size: int, head_dim: int) -> None:
    """Write known K and V through vLLM's own CPU cache kernel and check where they land:
    K as [dim][token], V as [token][dim] inside each (block, head). A vLLM whose kernel lays
    them out otherwise is refused here, instead of corrupting every transfer."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    cache = torch.zeros(2, 1, block_size, 2 * head_dim, dtype=dtype)
    k_cache, v_cache = cache.view(2, 1, 2 * block_size, head_dim).chunk(2, dim=2)
    num_tokens = min(3, block_size)
    key = torch.arange(1, num_tokens * head_dim + 1, dtype=dtype).reshape(num_tokens, 1, -1)
    slots = torch.arange(block_size, block_size + num_tokens)  # block 1, tokens 0..
    ops.cpu_attn_reshape_and_cache(key, -key, k_cache, v_cache, slots, isa)
    got = cache[1, 0].reshape(-1)
    want = torch.zeros_like(got)
    k_part = want[: block_size * head_dim].view(head_dim, block_size)
    v_part = want[block_size * head_dim :].view(block_size, head_dim)
    k_part[:, :num_tokens] = key[:, 0, :].T
    v_part[:num_tokens] = -key[:, 0, :]
    if not torch.equal(got, want):
        raise ValueError(
            f"vLLM's CPU attention (isa {isa!r}, block size {block_size}, head dim {head_dim}) "
            "lays KV out differently from what kvpush knows ([head][K dim x token][V token x "
            "dim]); refusing to transfer"
        )
