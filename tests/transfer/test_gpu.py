"""The push engine with CUDA memory: prefill and decode in two processes on one GPU.

Run on a CUDA host with `pytest -m gpu tests/transfer/test_gpu.py` (docs/benchmarks.md says
how it ran on an H200 and an H100); on a host without CUDA every test here is skipped, with
that reason.
"""

from __future__ import annotations

import os
import re

import pytest

from kvpush.bench.harness import Side
from kvpush.transfer.wire import PrefillAddress
from tests.transfer.conftest import (
    SPEC,
    assert_idle,
    decode_config,
    free_port,
    prefill_config,
    spec,
    wait_for,
)
from tests.transfer.test_faults import check_block_sizes, sides, tp1_to_tp2, tp2_to_tp1
from tests.transfer.test_push import assert_landed, new_key, push


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.nixl,
    pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU (PyTorch sees none here)"),
]
__all__ = ["sides"]  # the fixture, shared with test_faults
CUDA = spec(device="cuda")
TRANSPORT = re.compile(r"\b(cuda_ipc|cuda_copy|gdr_copy|rc_mlx5|rc_verbs|tcp|sysv|posix|cma)\b")


@pytest.fixture(scope="module")
def cuda_pair(tmp_path_factory):
    """Two endpoints over VRAM; UCX prints which protocol and transport each WRITE takes."""
    log_dir = tmp_path_factory.mktemp("ucx")
    saved = {k: os.environ.get(k) for k in ("UCX_PROTO_INFO", "KVPUSH_CHILD_LOG_DIR")}
    os.environ |= {"UCX_PROTO_INFO": "y", "KVPUSH_CHILD_LOG_DIR": str(log_dir)}
    port = free_port()
    try:
        prefill = Side("prefill", prefill_config(port), CUDA, seed=11)
        decode = Side("decode", decode_config(), CUDA)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield prefill, decode, PrefillAddress("127.0.0.1", port), log_dir
    prefill.close()
    decode.close()


@pytest.mark.parametrize("order", ["register", "prefill-first", "prepared"])
def test_cuda_regions_register_and_writes_land_byte_exact(cuda_pair, order):
    prefill, decode, address, _ = cuda_pair
    out = push(prefill, decode, address, [1, 2, 3, 4], [10, 11, 12, 13], 64, order=order)
    assert out.num_descs == SPEC.num_regions
    assert_idle(prefill, decode)


def test_fragmented_cuda_blocks_post_one_descriptor_per_run(cuda_pair):
    prefill, decode, address, _ = cuda_pair
    out = push(prefill, decode, address, [1, 2, 3, 7, 8], [20, 21, 40, 41, 42], 80)
    assert out.num_descs == 3 * SPEC.num_regions  # runs: 1-2 -> 20-21, 3 -> 40, 7-8 -> 41-42
    assert_idle(prefill, decode)


def test_cached_prefix_on_cuda_is_not_written_even_mid_block(cuda_pair):
    prefill, decode, address, _ = cuda_pair
    push(prefill, decode, address, [1, 2, 3], [5, 6, 7], 48, cached=24)
    assert_idle(prefill, decode)


def test_ucx_reports_the_transport_that_carried_the_writes(cuda_pair):
    """Not a speed claim: which UCX transports the VRAM-to-VRAM WRITEs used, printed (the
    benchmark log quoted it). A GPU-to-GPU path in one host is cuda_ipc (or cuda_copy staging)."""
    prefill, decode, address, log_dir = cuda_pair
    push(prefill, decode, address, [1], [2], 16)
    lines = [
        ln.rstrip()
        for f in sorted(log_dir.iterdir())
        for ln in f.read_text(errors="replace").splitlines()
        if TRANSPORT.search(ln)
    ]
    print("\n".join(dict.fromkeys(lines)))
    seen = {m for ln in lines for m in TRANSPORT.findall(ln)}
    assert seen & {"cuda_ipc", "cuda_copy", "gdr_copy"}, f"UCX named no CUDA transport: {seen}"


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 32), (32, 16)])
def test_cuda_block_size_mismatch_lands_token_exact(sides, src_bs, dst_bs):
    check_block_sizes(sides, src_bs, dst_bs, device="cuda")


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layer_by_layer"])
def test_cuda_tp1_prefill_to_tp2_decode_splits_heads(sides, layered):
    tp1_to_tp2(sides, device="cuda", layered=layered)


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layer_by_layer"])
def test_cuda_tp2_prefill_to_tp1_decode_gathers_heads(sides, layered):
    tp2_to_tp1(sides, device="cuda", layered=layered)


def test_batch_copy_kernel_moves_scattered_rows_byte_exact():
    """The gather/scatter kernel of the staged candidate (issue 12) against torch slicing:
    rows of mixed lengths and alignments, into a packed buffer and back out."""
    import numpy as np
    import torch

    from kvpush.transfer.batchcopy import copy_rows, word_size

    rng = np.random.default_rng(5)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    for word in (8, 1):
        starts = rng.choice(np.arange(0, (1 << 20) - 8192, 4096), 64, replace=False)
        lengths = rng.integers(1, 512, 64) * word
        starts = starts + (0 if word == 8 else 3)
        packed = torch.zeros(int(lengths.sum()), dtype=torch.uint8, device="cuda")
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        copy_rows(src.data_ptr() + starts, packed.data_ptr() + offsets, lengths)
        back = torch.zeros_like(src)
        copy_rows(packed.data_ptr() + offsets, back.data_ptr() + starts, lengths)
        torch.cuda.synchronize()
        assert word_size(starts, offsets, lengths) == word
        for s, o, n in zip(starts, offsets, lengths, strict=True):
            assert torch.equal(packed[o : o + n], src[s : s + n])
            assert torch.equal(back[s : s + n], src[s : s + n])
        outside = torch.ones_like(src, dtype=torch.bool)
        for s, n in zip(starts, lengths, strict=True):
            outside[s : s + n] = False
        assert not back[outside].any(), "the scatter wrote outside its rows"


def test_batch_copy_kernel_repeats_relative_rows_in_every_region():
    """Rows relative to region bases (layout.RegionPlan): each row copied once per region."""
    import numpy as np
    import torch

    from kvpush.transfer.batchcopy import copy_rows

    src = torch.randint(0, 256, (3, 4096), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    rel_s, rel_d, n = np.array([0, 1024, 3000]), np.array([2048, 0, 3072]), np.array([512, 8, 96])
    bases_s = np.array([src[i].data_ptr() for i in range(3)])
    bases_d = np.array([dst[i].data_ptr() for i in range(3)])
    copy_rows(rel_s, rel_d, n, None, bases_s, bases_d)
    torch.cuda.synchronize()
    want = torch.zeros_like(src)
    for r in range(3):
        for s, d, k in zip(rel_s, rel_d, n, strict=True):
            want[r, d : d + k] = src[r, s : s + k]
    assert torch.equal(dst, want)


STAGED = {"staging_bytes": 64 << 20, "staging_min_descs": 1}  # every push with 1+ runs


def test_cuda_staged_push_of_scattered_blocks_is_one_write_byte_exact(sides):
    port = free_port()
    prefill = sides("prefill", prefill_config(port, **STAGED), CUDA)
    decode = sides("decode", decode_config(**STAGED), CUDA)
    address = PrefillAddress("127.0.0.1", port)
    out = push(prefill, decode, address, [5, 9, 7, 8, 30], [20, 41, 30, 3, 12], 80)
    assert out.num_descs == 1
    decode.call("reset")
    push(prefill, decode, address, [0, 4, 2, 9], [50, 51, 8, 53], 60, cached=24)
    assert [c["staged"] for c in (prefill.call("counters"), decode.call("counters"))] == [2, 2]
    assert_idle(prefill, decode)


def test_cuda_stages_by_default_once_a_plan_has_many_descriptors(sides):
    """The defaults on VRAM: a staging area, and staging from 512 descriptors up."""
    port = free_port()
    big = spec(device="cuda", num_blocks=1024)
    prefill = sides("prefill", prefill_config(port), big)
    decode = sides("decode", decode_config(), big)
    address = PrefillAddress("127.0.0.1", port)
    few = push(prefill, decode, address, [1, 3, 5], [2, 4, 6], 48)  # 3 runs x 2 regions
    many = push(prefill, decode, address, list(range(0, 600, 2)), list(range(1, 601, 2)), 4800)
    assert (few.num_descs, many.num_descs) == (3 * SPEC.num_regions, 1)
    assert_idle(prefill, decode)


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 32), (32, 16), (16, 64), (64, 16)])
def test_cuda_staged_block_size_change_lands_token_exact(sides, src_bs, dst_bs):
    started = check_block_sizes(sides, src_bs, dst_bs, device="cuda", **STAGED)
    assert [s.call("counters")["staged"] for s in started] == [1, 1]


def test_cuda_staged_tp_split_and_gather(sides):
    split = tp1_to_tp2(sides, device="cuda", **STAGED)
    assert [s.call("counters")["staged"] for s in split] == [2, 1, 1]
    gather = tp2_to_tp1(sides, device="cuda", **STAGED)
    assert [s.call("counters")["staged"] for s in gather] == [1, 1, 2]


def test_cuda_cross_layer_run_is_one_descriptor_and_a_staged_scatter_lands(sides):
    """Block-outer (cross-layer) VRAM, one buffer per side: a run of whole blocks is one
    descriptor for every region; a scattered push past the threshold is staged."""
    port = free_port()
    cross = spec(device="cuda", cross_layer=True, num_regions=8)
    staged = {"staging_bytes": 64 << 20, "staging_min_descs": 3}
    prefill = sides("prefill", prefill_config(port, **staged), cross)
    decode = sides("decode", decode_config(**staged), cross)
    address = PrefillAddress("127.0.0.1", port)
    assert push(prefill, decode, address, [1, 2, 3, 4], [10, 11, 12, 13], 64).num_descs == 1
    assert push(prefill, decode, address, [5, 6, 7], [20, 21, 30], 48).num_descs == 2
    assert push(prefill, decode, address, [5, 9, 7, 8, 30], [20, 41, 30, 3, 12], 80).num_descs == 1
    assert [s.call("counters")["staged"] for s in (prefill, decode)] == [1, 1]
    assert_idle(prefill, decode)


def test_cuda_layers_written_as_a_forward_computes_them_land_byte_exact(sides):
    """Layer by layer on VRAM: a sleep kernel stands in for each of four layers' compute,
    each layer's computed() carries its CUDA event, and the endpoint writes a layer only once
    its event has completed; the push writes the last layer with the notification."""
    layers = spec(device="cuda", num_regions=8)
    port = free_port()
    prefill = sides("prefill", prefill_config(port), layers)
    decode = sides("decode", decode_config(), layers)
    address = PrefillAddress("127.0.0.1", port)
    src, before = prefill.call("regions"), decode.call("regions")
    key = new_key()
    fd = decode.call("expect", key, address, [20, 21, 22], 48)
    wait_for(lambda: prefill.call("gauges")["pending_match"] == 1, 5, "registration at prefill")
    fid, _ = prefill.call("forward", key, [5, 6, 7], 48, 0.005, True)
    out_p, out_d = prefill.wait(fid), decode.wait(fd)
    assert out_p.ok and out_d.ok and out_d.first_token == 1, (out_p, out_d)
    assert prefill.call("counters")["layer_writes"] >= 1
    assert_landed(prefill, decode, src, before, [5, 6, 7], [20, 21, 22], 48)
    assert_idle(prefill, decode)
