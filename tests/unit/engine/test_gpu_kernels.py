"""The Triton paged-attention decode kernel against a float32 reference on random block tables
(lengths not multiples of the block size, GQA ratios 1/4/8). Skipped where no GPU exists."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def reference(q, k_cache, v_cache, tables, lens, scale):
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(lens[i])
        k = k_cache[tables[i]].reshape(-1, hkv, d)[:n].float().repeat_interleave(h // hkv, 1)  # [n, H, D]
        v = v_cache[tables[i]].reshape(-1, hkv, d)[:n].float().repeat_interleave(h // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
    return out


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_decode_matches_reference(group, dtype, head_dim):
    from splitserve.engine.kernels.triton_paged_attention import paged_decode_attention

    torch.manual_seed(group * 1000 + head_dim)
    hkv, bs, num_blocks = 4, 16, 400
    h = hkv * group
    lens = torch.tensor([1, 15, 17, 300, 1023, 777, 16, 513], device="cuda")
    b = len(lens)
    max_blocks = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(num_blocks, device="cuda")[:max_blocks] for _ in range(b)])
    k_cache = torch.randn(num_blocks, bs, hkv, head_dim, device="cuda").to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, head_dim, device="cuda").to(dtype)
    q = torch.randn(b, h, head_dim, device="cuda").to(dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert not torch.isnan(out).any()
    ref = reference(q, k_cache, v_cache, tables, lens, scale)
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel.item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rms_norm_matches_torch(dtype):
    from splitserve.engine.kernels.triton_norm_rope import rms_norm

    x = torch.randn(37, 4096, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(dtype)
    ref = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = rms_norm(x, w, 1e-5)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rotary_in_place_on_a_qkv_view(dtype):
    from splitserve.engine.kernels.triton_norm_rope import rotary_inplace
    from splitserve.engine.models.layers import RotaryEmbedding, _apply

    rope = RotaryEmbedding(128, 4096, 500000.0, None).to("cuda")
    rope.build_tables("cuda")
    positions = torch.randint(0, 4096, (23,), device="cuda")
    cos, sin = rope.lookup(positions)
    qkv = torch.randn(23, (32 + 2 * 8) * 128, device="cuda").to(dtype)
    q = qkv[:, : 32 * 128].view(23, 32, 128)
    want = _apply(q.clone(), cos, sin)
    k_before = qkv[:, 32 * 128 :].clone()
    rotary_inplace(q, cos, sin)
    assert (q.float() - want.float()).norm() / want.float().norm() < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(qkv[:, 32 * 128 :], k_before)  # only q's heads were touched


def test_fused_silu_mul_matches_torch():
    from splitserve.engine.kernels.triton_norm_rope import silu_mul

    x = torch.randn(19, 2 * 14336, device="cuda").to(torch.bfloat16)
    gate, up = x.split(14336, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = silu_mul(x)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_rms_norm_updates_the_residual(dtype):
    from splitserve.engine.kernels.triton_norm_rope import add_rms_norm

    x = torch.randn(37, 4096, device="cuda", dtype=dtype)
    res = torch.randn(37, 4096, device="cuda", dtype=dtype)
    w = torch.rand(4096, device="cuda", dtype=dtype) + 0.5
    want_res = (x.float() + res.float()).to(dtype)
    s = want_res.float()
    want = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float() * w.float()
    got = add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(got.float(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


def moe_reference(x, w13, w2, ids, weights, start):
    """float32 loop over (token, expert) pairs whose expert is local."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if 0 <= e < w13.shape[0]:
                gu = w13[e].float() @ x[t].float()
                h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                out[t] += weights[t, j].float() * (w2[e].float() @ h)
    return out


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("ep", [(0, 16), (8, 8)])  # (first local expert, local experts) of 16
def test_fused_moe_matches_reference(tokens, ep):
    from splitserve.engine.kernels.triton_moe import fused_moe

    torch.manual_seed(tokens)
    start, n_local = ep
    hidden, inter, top_k = 256, 96, 4
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = (torch.randn(n_local, 2 * inter, hidden, device="cuda") * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(n_local, hidden, inter, device="cuda") * 0.05).to(torch.bfloat16)
    scores = torch.randn(tokens, 16, device="cuda").softmax(-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    got = fused_moe(x, w13, w2, ids, weights, start).float()
    want = moe_reference(x, w13, w2, ids, weights, start)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
