"""Paged attention over the block-table KV cache (the portable PyTorch path; GPU kernels plug in here).

KV cache layout, per layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`, so one block's
bytes are contiguous and a run of consecutive block ids is one contiguous region (what the KV transfer sends).

With `batch_invariant` every row, decode or prefill, reads its keys from the cache and reduces them in the same
fixed order whatever else is in the step: the tiled kernel on the CPU, the paged decode kernel on CUDA (a prefill
row is a decode row of its own length there). Otherwise decodes and prefill chunks take the fastest kernels,
whose reduction order follows the shapes of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.engine.kernels import HAS_TRITON


@dataclass
class PrefillSeq:
    token_start: int  # index of the chunk's first token in the packed batch
    num_tokens: int  # tokens in this chunk
    context_start: int  # tokens of this sequence already in the cache before the chunk
    block_ids: torch.Tensor  # [num_blocks] long, on device


@dataclass
class AttentionMetadata:
    """What one forward pass needs to read and write the paged cache. Decodes come first in the batch."""

    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset
    block_size: int
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] long
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] long, including the new token
    prefills: list[PrefillSeq] = field(default_factory=list)
    # Called after layer i's K/V for this batch are written to the cache (KV streaming hook).
    on_layer_written: Callable[[int], None] | None = None
    batch_invariant: bool = False  # each row's result independent of the step's other rows (module docstring)
    max_seq_len: int = 0  # batch_invariant on CUDA: the longest sequence (fixes the decode kernel's merge width)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter new K/V ([T, Hkv, D]) into their cache slots."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D] (this step's keys, already in the cache)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    if meta.batch_invariant:
        return _invariant(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        decode = _triton_decode if q.is_cuda and HAS_TRITON else _decode_attention
        out[:nd] = decode(q[:nd], k_cache, v_cache, meta, scale)
    for p in meta.prefills:
        sl = slice(p.token_start, p.token_start + p.num_tokens)
        out[sl] = _prefill_attention(q[sl], k[sl], v[sl], k_cache, v_cache, p, scale)
    return out


def _invariant(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if q.is_cuda and HAS_TRITON:
        return _triton_rows(q, k_cache, v_cache, meta, scale)
    from splitserve.engine.kernels import tiled_attention

    tile = tiled_attention.tile_for(meta.block_size)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = tiled_attention.decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                          scale, tile)
    for p in meta.prefills:
        sl = slice(p.token_start, p.token_start + p.num_tokens)
        out[sl] = tiled_attention.prefill(q[sl], k_cache, v_cache, p.block_ids, p.context_start, scale, tile)
    return out


def _triton_rows(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Every row through the paged decode kernel: a prefill chunk's row at position p is a decode of length p + 1
    over its sequence's blocks. The kernel reduces each row over fixed 256-token partitions and merges them over
    a width fixed by `max_seq_len`, so a row's result is the same in any batch."""
    from splitserve.engine.kernels.triton_paged_attention import paged_decode_attention, parts_pad_for

    tables, lens = [], []
    if meta.num_decodes:
        tables.append(meta.decode_block_tables)
        lens.append(meta.decode_seq_lens)
    for p in meta.prefills:
        tables.append(p.block_ids.unsqueeze(0).expand(p.num_tokens, -1))
        lens.append(torch.arange(p.context_start + 1, p.context_start + p.num_tokens + 1, device=q.device))
    if len(tables) == 1:
        table, seq_lens = tables[0], lens[0]
    else:
        width = max(t.shape[1] for t in tables)
        table = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
        seq_lens = torch.cat(lens)
    return paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale,
                                  parts_pad=parts_pad_for(meta.max_seq_len, meta.block_size))


def _triton_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from splitserve.engine.kernels.triton_paged_attention import paged_decode_attention

    return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale)


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    tables = meta.decode_block_tables
    # [B, Hkv, L, D] strided views of the gathered blocks: SDPA reads them in place, GQA without repeats
    k = k_cache[tables].view(b, -1, hkv, d).transpose(1, 2)
    v = v_cache[tables].view(b, -1, hkv, d).transpose(1, 2)
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < meta.decode_seq_lens[:, None]  # [B, L]
    o = F.scaled_dot_product_attention(q.view(b, h, 1, d), k, v, attn_mask=valid[:, None, None, :],
                                       scale=scale, enable_gqa=hkv != h)
    return o.view(b, h, d)


def _prefill_attention(q, k, v, k_cache, v_cache, p: PrefillSeq, scale: float) -> torch.Tensor:
    t, h, d = q.shape
    hkv = k.shape[1]
    if p.context_start == 0:
        keys, values = k, v
        mask = None
    else:
        seq_len = p.context_start + t
        keys = k_cache[p.block_ids].view(-1, hkv, d)[:seq_len]
        values = v_cache[p.block_ids].view(-1, hkv, d)[:seq_len]
        qpos = torch.arange(p.context_start, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]  # [t, seq_len]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=hkv != h,
    )
    return o.squeeze(0).transpose(0, 1)
