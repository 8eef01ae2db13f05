"""Fused elementwise kernels for the decode hot path on CUDA (Triton): RMSNorm (alone, or after adding into
the residual stream), rotary embedding applied in place, and SiLU(gate) * up. Each replaces 3-12 small
PyTorch kernels per call (benchmarks/gpu_engine.py measures each against the PyTorch ops it replaces)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (x * r).to(w.dtype).to(tl.float32) * w.to(tl.float32)  # HF order: normalise, cast, then scale
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + res).to(res_ptr.dtype.element_ty)  # the residual stream stays in the model dtype, as in HF
    tl.store(res_ptr + row * stride_r + cols, s, mask=mask)
    s = s.to(tl.float32)
    r = tl.rsqrt(tl.sum(s * s, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (s * r).to(w.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place), then RMSNorm of the new residual; x, residual: [T, n] contiguous rows."""
    assert x.stride(-1) == 1 and residual.stride(-1) == 1 and x.shape == residual.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0),
                                        n, eps, BLOCK=triton.next_power_of_2(n))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, eps,
                                     BLOCK=triton.next_power_of_2(n))
    return out.view(shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + i).to(tl.float32)
    x2 = tl.load(base + HALF + i).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_c + i)
    s = tl.load(sin_ptr + t * stride_c + i)
    tl.store(base + i, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty))
    tl.store(base + HALF + i, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty))


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (rows may be strided views, e.g. into a fused qkv output); cos/sin: [T, 1, D] float32
    (the two halves of each row are equal). Rotates x in place and returns it."""
    t, heads, d = x.shape
    assert x.stride(2) == 1 and cos.stride(-1) == 1
    _rope_kernel[(t, heads)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HALF=d // 2)
    return x


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32) * u  # silu(gate), cast, times up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate first) -> silu(gate) * up: [T, I], one kernel."""
    t, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out
