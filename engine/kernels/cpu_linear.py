"""CPU linear layers with weights pre-packed once for oneDNN's JIT kernels.

At decode batch sizes a CPU matmul re-packs the weight on every call; packing once at load time cut
SmolLM2's matmul time by about a third on a 2-core AVX2 machine (benchmarks/engine_throughput.py).
"""

from __future__ import annotations

import torch
from torch import nn


def packed_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int = 16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self._op = torch.ops.mkldnn._linear_pointwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 nn.Linear on the CPU with a PackedLinear; returns how many were packed."""
    if not packed_linear_available():
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32:
                packed = PackedLinear(child)
                packed._forward_hooks.update(child._forward_hooks)  # e.g. tensor parallelism's all-reduce
                setattr(module, name, packed)
                count += 1
    return count
