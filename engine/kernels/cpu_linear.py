"""CPU linear layers with weights pre-packed once for oneDNN's JIT kernels.

At decode batch sizes a CPU matmul re-packs the weight on every call; packing once at load time cut
SmolLM2's matmul time by about a third on a 2-core AVX2 machine (benchmarks/engine_throughput.py).

With `min_rows=2` (batch-invariant mode) a one-row input is computed as two identical rows: oneDNN's matrix path
computes every row the same whatever the number of rows, but a single row takes its vector path, which sums in
another order (SmolLM2's down projection differs in the last bits); two rows cost the same time as one.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.models.moe import SparseMoE


def packed_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(w: torch.Tensor, batch_hint: int = 16) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), batch_hint)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., m, k] with its last row repeated up to `rows` rows (x itself when it has that many): a product
    computed on it and cut back to m rows gives each row as the math library computes rows of a longer product."""
    m = x.shape[-2]
    if m >= rows:
        return x
    return torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], rows - m, x.shape[-1])], -2)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  min_rows: int = 1) -> torch.Tensor:
    """x [M, in] @ packed weight -> [M, out]; fewer than `min_rows` rows are repeated up to it and cut after."""
    m = x.shape[0]
    if 0 < m < min_rows:
        return torch.ops.mkldnn._linear_pointwise(pad_rows(x, min_rows), packed, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int = 16, min_rows: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.packed, self.bias, self.min_rows)


def pack_linears(model: nn.Module, min_rows: int = 1) -> int:
    """Replace every float32 nn.Linear on the CPU with a PackedLinear; returns how many were packed. With
    `min_rows` > 1 the float32 experts of sparse MoE blocks are packed too (a copy beside their weights: their
    plain matmuls reduce in an order that follows the number of tokens routed to the expert)."""
    if not packed_linear_available():
        return 0
    count = 0
    for module in list(model.modules()):
        if isinstance(module, SparseMoE) and min_rows > 1 and module.w13.device.type == "cpu" \
                and module.w13.dtype == torch.float32:
            module.packed_experts = [(pack_weight(module.w13[e]), pack_weight(module.w2[e]))
                                     for e in range(module.w13.shape[0])]
            module.min_rows = min_rows
            count += 2 * len(module.packed_experts)
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32:
                packed = PackedLinear(child, min_rows=min_rows)
                packed._forward_hooks.update(child._forward_hooks)  # e.g. tensor parallelism's all-reduce
                setattr(module, name, packed)
                count += 1
    return count
