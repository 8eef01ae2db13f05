"""Building blocks shared by the model files: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.kernels import HAS_TRITON


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`: (RMSNorm(residual + x), residual + x), updating residual in place on CUDA."""
        if residual is not None:
            if x.is_cuda and HAS_TRITON and x.dim() == 2:
                from splitserve.engine.kernels.triton_norm_rope import add_rms_norm

                return add_rms_norm(x, residual, self.weight, self.eps), residual
            residual = residual + x
            return self._norm(residual), residual
        if x.is_cuda and HAS_TRITON:
            from splitserve.engine.kernels.triton_norm_rope import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 tables, e.g. after the module was created on the meta device."""
        if device is None:
            device = self.cos.device
        if str(device) == "meta":
            return
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions` ([T]), each [T, 1, D] float32: computed once per forward pass."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        # q: [T, H, D], k: [T, Hkv, D]
        cos, sin = cos_sin
        if q.is_cuda and HAS_TRITON:  # in place, one kernel each (q and k may be views into the qkv output)
            from splitserve.engine.kernels.triton_norm_rope import rotary_inplace

            return rotary_inplace(q, cos, sin), rotary_inplace(k, cos, sin)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.addcmul(xf * cos, rotated, sin).to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and HAS_TRITON and gate_up.dim() == 2:
            from splitserve.engine.kernels.triton_norm_rope import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
