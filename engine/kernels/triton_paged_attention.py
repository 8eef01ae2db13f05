"""Paged-attention decode kernel (Triton): reads K/V in place through the block table, GQA-aware.

Flash-decoding layout: the grid is (sequence, KV head, partition); each program walks the blocks of one
partition of one sequence for one KV head, computing all of that head's query heads at once (so K and V are
read once per group), with an online softmax. A second kernel merges the partitions. No gather copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PARTITION_BLOCKS = 16  # KV blocks per partition (256 tokens at block size 16)


@triton.jit
def _paged_decode_partial(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_tb,
    max_parts,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PART_BLOCKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    first_block = part * PART_BLOCKS
    if first_block * BLOCK_SIZE >= seq_len:
        return
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    g_mask = g < GROUP
    # [GROUP_PAD, HEAD_DIM] query heads of this KV head
    q = tl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    last_block = tl.minimum(first_block + PART_BLOCKS, num_blocks)
    for b in range(first_block, last_block):
        block_id = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)
        base = block_id * stride_kb + kv_head * stride_kh
        offs = base + t[:, None] * stride_ks + d[None, :]  # [BLOCK_SIZE, HEAD_DIM]
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [GROUP_PAD, BLOCK_SIZE]
        pos = b * BLOCK_SIZE + t
        s = tl.where((pos < seq_len)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    row = (seq * tl.num_programs(1) + kv_head) * max_parts + part
    tl.store(m_ptr + row * GROUP_PAD + g, m_i)
    tl.store(l_ptr + row * GROUP_PAD + g, l_i)
    tl.store(acc_ptr + (row * GROUP_PAD + g)[:, None] * HEAD_DIM + d[None, :], acc)


@triton.jit
def _paged_decode_merge(
    m_ptr, l_ptr, acc_ptr, lens_ptr, out_ptr,
    stride_ob, stride_oh,
    max_parts,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PART_TOKENS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + seq)
    n_parts = tl.cdiv(seq_len, PART_TOKENS)
    p = tl.arange(0, PARTS_PAD)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    rows = (seq * tl.num_programs(1) + kv_head) * max_parts + p  # [PARTS_PAD]
    valid = p < n_parts
    m = tl.load(m_ptr + rows[:, None] * GROUP_PAD + g[None, :], mask=valid[:, None], other=float("-inf"))
    l_ = tl.load(l_ptr + rows[:, None] * GROUP_PAD + g[None, :], mask=valid[:, None], other=0.0)
    m_max = tl.max(m, 0)  # [GROUP_PAD]
    w = tl.where(valid[:, None], tl.exp(m - m_max[None, :]), 0.0)  # [PARTS_PAD, GROUP_PAD]
    denom = tl.sum(w * l_, 0)
    out = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for i in range(0, n_parts):
        r = (seq * tl.num_programs(1) + kv_head) * max_parts + i
        a = tl.load(acc_ptr + (r * GROUP_PAD + g)[:, None] * HEAD_DIM + d[None, :])
        mi = tl.load(m_ptr + r * GROUP_PAD + g)
        out += a * tl.exp(mi - m_max)[:, None]
    out = out / denom[:, None]
    g_mask = g < GROUP
    tl.store(out_ptr + seq * stride_ob + (kv_head * GROUP + g)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def parts_pad_for(max_seq_len: int, block_size: int) -> int:
    """The merge width that covers every sequence up to `max_seq_len` tokens: a fixed width makes each row's
    merge the same reduction whatever the batch's widest table (batch-invariant mode)."""
    return max(16, triton.next_power_of_2(triton.cdiv(max(1, max_seq_len), PARTITION_BLOCKS * block_size)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           parts_pad: int | None = None) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] (int32/int64);
    seq_lens: [B] (tokens including the new one). Returns [B, H, D] in q's dtype.

    The partition count follows the block table's width, so no host sync is needed (CUDA-graph safe). Each row's
    partitions follow its own length; the merge's width follows the table's unless `parts_pad` fixes it.
    """
    b, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = h // hkv
    group_pad = max(16, triton.next_power_of_2(group))
    part_tokens = PARTITION_BLOCKS * bs
    max_parts = max(1, triton.cdiv(block_tables.shape[1] * bs, part_tokens))
    m = torch.empty((b, hkv, max_parts, group_pad), dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty((b, hkv, max_parts, group_pad, d), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _paged_decode_partial[(b, hkv, max_parts)](
        q, k_cache, v_cache, block_tables, seq_lens, m, l_, acc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        max_parts, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_SIZE=bs, PART_BLOCKS=PARTITION_BLOCKS,
    )
    _paged_decode_merge[(b, hkv)](
        m, l_, acc, seq_lens, out, out.stride(0), out.stride(1), max_parts,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, PART_TOKENS=part_tokens,
        PARTS_PAD=max(parts_pad or 16, triton.next_power_of_2(max_parts)),
    )
    return out
