"""The layerwise connector's view of a layer's KV cache as NIXL regions (`in_vllm.layerwise_peers._regions`): a
block must be one dense span of memory, in whatever order the attention backend lays its dimensions out. Plain
torch tensors shaped as vLLM's backends shape them; no vLLM, no NIXL."""

from __future__ import annotations

import pytest
import torch

from splitserve.vllm_engine.in_vllm.layerwise_peers import _regions

BLOCKS = 12


def test_blocks_first_and_contiguous_is_one_region():
    kv = torch.empty(BLOCKS, 2, 16, 4, 8, dtype=torch.bfloat16)  # [blocks, K/V, positions, heads, head_dim]
    [r] = _regions(kv, BLOCKS, "layer.0")
    assert (r.addr, r.block_bytes, r.stride, r.num_blocks) == (kv.data_ptr(), 2 * 16 * 4 * 8 * 2, 2 * 16 * 4 * 8 * 2,
                                                                 BLOCKS)


def test_a_permuted_view_over_dense_blocks_is_one_region():
    """Hopper's FlashAttention in vLLM 0.26: logical [blocks, heads, positions, 2 x head_dim] over memory ordered
    [blocks, positions, heads, ...] (seen on an H200: shape (3072, 8, 32, 256), strides (65536, 256, 2048, 1))."""
    kv = torch.empty(BLOCKS, 32, 8, 256, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    assert not kv[0].is_contiguous()
    [r] = _regions(kv, BLOCKS, "layer.0")
    assert r.block_bytes == r.stride == 32 * 8 * 256 * 2 and r.num_blocks == BLOCKS


def test_k_and_v_apart_are_two_regions():
    kv = torch.empty(2, BLOCKS, 16, 4, 8)  # [K/V, blocks, positions, heads, head_dim]
    k, v = _regions(kv, BLOCKS, "layer.0")
    assert k.addr == kv[0].data_ptr() and v.addr == kv[1].data_ptr()
    assert k.block_bytes == k.stride == 16 * 4 * 8 * 4


def test_a_block_with_gaps_is_refused_in_one_line():
    kv = torch.empty(BLOCKS, 8, 64)[:, :, :32]  # each block's rows leave half their span unused
    with pytest.raises(ValueError, match=r"cannot lay out layer layer\.3's cache \(12, 8, 32\)"):
        _regions(kv, BLOCKS, "layer.3")
