"""Fused mixture-of-experts on CUDA: grouped GEMMs over (token, expert) pairs sorted by expert, with no host sync.

`moe_align` sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M, all on the device
with static shapes (the padded length is bounded in advance), so a decode step with MoE layers can be captured
in a CUDA graph. Each program of `_moe_gemm` takes BLOCK_M pairs of one expert and reads that expert's weight
tile once for all of them. Pairs routed to experts that live on another rank (expert parallelism) are not
placed, and their rows of the output stay zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.kernels.triton_norm_rope import silu_mul


@triton.jit
def _moe_gemm(a_ptr, w_ptr, c_ptr, weight_ptr, sorted_ptr, block_expert_ptr,
              N, K, num_pairs, top_k,
              stride_am, stride_we, stride_wn, stride_cm,
              ROW_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # C[pair, n] = sum_k A[row(pair), k] * W[expert, n, k] (* routing weight of pair)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # padding beyond the last expert, or nothing of this rank's
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    row = pair if ROW_PER_PAIR else pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def moe_align(topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int):
    """Pairs sorted by local expert, each expert's run padded to `block_m`.

    Returns (sorted_pairs [max_padded] int32 with `num_pairs` as padding, block_expert [max_padded / block_m]
    int32 with -1 for blocks holding nothing).
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    dev = flat.device
    local = flat - expert_start
    bucket = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: another rank's
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    run_start = torch.cumsum(counts, 0) - counts  # where each bucket's pairs start in sorted order
    rank_in_run = torch.arange(num_pairs, device=dev) - run_start[sorted_bucket]
    max_padded = triton.cdiv(num_pairs + min(num_local, num_pairs) * (block_m - 1), block_m) * block_m
    is_local = sorted_bucket < num_local
    dest = torch.where(is_local, (ends - padded)[sorted_bucket.clamp(max=num_local - 1)] + rank_in_run, max_padded)
    sorted_pairs = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1).to(torch.int32)
    return sorted_pairs[:max_padded], block_expert


def _config(num_pairs: int, num_experts: int) -> dict:
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """x [T, H]; w13 [E_local, 2I, H] (gate; up); w2 [E_local, H, I]; topk_* [T, k] -> [T, H] in x.dtype."""
    t, h = x.shape
    k = topk_ids.shape[1]
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    num_pairs = t * k
    cfg = _config(num_pairs, num_local)
    bm = cfg["BLOCK_M"]
    sorted_pairs, block_expert = moe_align(topk_ids, expert_start, num_local, bm)
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    grid1 = (block_expert.numel(), triton.cdiv(two_i, cfg["BLOCK_N"]))
    _moe_gemm[grid1](x, w13, gate_up, weights, sorted_pairs, block_expert, two_i, h, num_pairs, k,
                     x.stride(0), w13.stride(0), w13.stride(1), gate_up.stride(0),
                     ROW_PER_PAIR=False, MUL_WEIGHT=False, **cfg)
    act = silu_mul(gate_up)  # [pairs, I]; rows of other ranks' pairs are never read
    out = torch.zeros(num_pairs, h, dtype=x.dtype, device=x.device)
    grid2 = (block_expert.numel(), triton.cdiv(h, cfg["BLOCK_N"]))
    _moe_gemm[grid2](act, w2, out, weights, sorted_pairs, block_expert, h, inter, num_pairs, k,
                     act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
                     ROW_PER_PAIR=True, MUL_WEIGHT=True, **cfg)
    return out.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
