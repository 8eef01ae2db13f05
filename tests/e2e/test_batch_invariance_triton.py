"""Batch invariance on the CUDA path, run in Triton's interpreter in a fresh interpreter process."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


TRITON_ROWS = r"""
import torch
from splitserve.engine.attention import AttentionMetadata, PrefillSeq, _triton_rows
torch.manual_seed(0)
bs, hkv, group, d, length = 16, 1, 2, 16, 272  # two 256-token partitions
k_cache, v_cache = torch.randn(20, bs, hkv, d), torch.randn(20, bs, hkv, d)
table = torch.randperm(20)[: length // bs]
q = torch.randn(length, hkv * group, d)
scale = d ** -0.5

def rows(q, decodes, lens, prefill):
    n = len(decodes)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(q), dtype=torch.long), block_size=bs, num_decodes=n,
                             decode_block_tables=torch.stack(decodes) if n else None,
                             decode_seq_lens=torch.tensor(lens) if n else None,
                             prefills=[PrefillSeq(n, len(q) - n, prefill, table)] if prefill is not None else [],
                             batch_invariant=True, max_seq_len=1024)
    return _triton_rows(q, k_cache, v_cache, meta, scale)

ref = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(0, 1)[None], k_cache[table].reshape(-1, hkv, d).transpose(0, 1)[None],
    v_cache[table].reshape(-1, hkv, d).transpose(0, 1)[None], is_causal=True, scale=scale,
    enable_gqa=True)[0].transpose(0, 1)
chunk = rows(q[256:], [], [], 256)  # a chunk after 256 cached positions
assert (chunk - ref[256:]).abs().max() < 1e-5
picked = [0, 16, 255, 270]
mixed = rows(torch.cat([q[picked], q[264:]]), [table] * 4, [p + 1 for p in picked], 264)
assert (mixed[:4] - ref[picked]).abs().max() < 1e-5
assert torch.equal(mixed[4:], chunk[8:]) and torch.equal(mixed[3], chunk[14])
alone = rows(q[[270]], [table], [271], None)
narrow = rows(q[[16]], [table[:2]], [17], None)  # a narrow table alone: the merge's width is the same
assert torch.equal(alone[0], chunk[14]) and torch.equal(narrow[0], mixed[1])
print("ok")
"""


def test_the_cuda_path_in_triton_s_interpreter():
    """The CUDA path's logic on the CPU (Triton's interpreter): a prefill row is a decode row of its own length,
    and a row gives the same result decoded alone, decoded in a batch or computed in a (chunked) prefill."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    res = subprocess.run([sys.executable, "-c", TRITON_ROWS], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
