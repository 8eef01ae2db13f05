"""Sparse mixture-of-experts block (Mixtral, Qwen3-MoE): top-k softmax routing over SwiGLU experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.kernels import HAS_TRITON


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.intermediate = intermediate
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        # Experts stacked: w13 = [gate; up] per expert, w2 = down.
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        # Experts [expert_start, expert_start + num_local) live here; expert parallelism narrows this range.
        self.expert_start = 0
        # CPU: each local expert's (w13, w2) pre-packed for oneDNN, and the fewest rows a matmul is given
        # (kernels.cpu_linear.pack_linears sets both)
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.min_rows = 1

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids and their weights per token: ([T, k] long, [T, k] float32)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        return self.expert_forward(x, experts, weights)

    def expert_forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the local experts' outputs for the tokens routed to them."""
        if x.is_cuda and HAS_TRITON:  # grouped GEMMs, no host sync (graph-capturable)
            from splitserve.engine.kernels.triton_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, experts, weights, self.expert_start)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = experts.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + self.expert_start).tolist()
        token_of = order // self.top_k
        pos = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            local = e - self.expert_start
            if 0 <= local < self.w13.shape[0]:
                idx = token_of[pos : pos + n]
                w = weights.view(-1)[order[pos : pos + n]]
                gate, up = self._expert_linear(x[idx], local, 0).split(self.intermediate, dim=-1)
                y = self._expert_linear(F.silu(gate) * up, local, 1)
                out.index_add_(0, idx, y.float() * w[:, None])
            pos += n
        return out.to(x.dtype)

    def _expert_linear(self, x: torch.Tensor, local: int, which: int) -> torch.Tensor:
        """x @ expert `local`'s w13 (which 0) or w2 (which 1), transposed."""
        if self.packed_experts is not None:
            from splitserve.engine.kernels.cpu_linear import packed_matmul

            return packed_matmul(x, self.packed_experts[local][which], min_rows=self.min_rows)
        return F.linear(x, (self.w13, self.w2)[which][local])
