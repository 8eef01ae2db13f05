"""Batch-invariant paged attention in PyTorch (the CPU path of `model.batch_invariant`): a query row's result
depends on its own query, position and keys only, never on the rows beside it, whether it is a decode, a row of
a prefill chunk, or a chunk starting after a prefix-cache hit or a load.

Keys and values are read from the cache (this step's are written first), in tiles of `tile` positions aligned to
position 0. Per tile, a row gets its max score, its sum of exponentials and its weighted values: two matmuls of
fixed inner size (head_dim for the scores, `tile` for the values), a max and a sum over `tile` columns. The tiles
are then merged left to right, one after another. A tile a row cannot see (past its position, or past a shorter
sequence in a decode batch) contributes exact zeros, so how many tiles the batch needed does not matter. What is
left to the math library: a matmul must compute each row the same whatever the number of rows (past its
short-product kernels: a product of fewer than MIN_ROWS rows is padded to it); tests/unit/engine/test_batch_invariance.py
checks it.
"""

from __future__ import annotations

import torch

from splitserve.engine.kernels.cpu_linear import pad_rows

TILE = 256  # KV positions per tile (at least the block size: `tile_for`)
QUERY_ROWS = 256  # prefill rows per pass: bounds the scores' memory ([kv_heads, tiles, rows * group, tile])
_NEG = torch.finfo(torch.float32).min
# rows below which a float32 product is padded (`_matmul`). The math library computes a row of a product the same
# whatever the number of rows only past its short-product kernels: with MKL on AVX-512 one row differs from two or
# more; on AVX2 (an AMD EPYC) products of 1-3 rows, 5-7 and 9-11 each differ from those of 4, 8 and 12 or more
MIN_ROWS = 16


def tile_for(block_size: int) -> int:
    return max(TILE, block_size)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, tile: int) -> torch.Tensor:
    """q: [B, H, D] (each row's last position is seq_lens - 1); caches [num_blocks, block_size, Hkv, D];
    block_tables [B, width] long (padded with any valid block id); seq_lens [B] long. Returns [B, H, D]."""
    b, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    n = _cdiv(int(seq_lens.max()), tile)
    per_tile = tile // bs
    width = n * per_tile
    tables = block_tables[:, :width]
    if tables.shape[1] < width:
        tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
    # past its own blocks a row reads its first block again: every block read is the row's own, whole and at
    # rest (a padding block could be one a KV transfer is writing), so the masked positions' values are finite
    # and their zero weights leave nothing behind
    own = torch.arange(width, device=q.device)[None, :] < _cdiv_t(seq_lens, bs)[:, None]
    tables = torch.where(own, tables, tables[:, :1])
    k, v = _gather(k_cache, v_cache, tables.reshape(-1), (b, n, tile))  # [Hkv, B, n, D, tile], [..., tile, D]
    kpos = torch.arange(n * tile, device=q.device)
    group = h // hkv
    qg = (q.float() * scale).view(b, hkv, group, d).transpose(0, 1).unsqueeze(2)  # [Hkv, B, 1, group, D]
    qpos = (seq_lens - 1).view(1, b, 1, 1, 1)
    m, sums, acc = _tiles(qg, k, v, qpos, kpos.view(n, 1, tile), 0)
    return _merge(m, sums, acc).transpose(0, 1).reshape(b, h, d).to(q.dtype)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
            context_start: int, scale: float, tile: int) -> torch.Tensor:
    """q: [t, H, D] for positions context_start .. context_start + t - 1 of one sequence, whose keys up to there
    are in the cache at `block_ids` [num_blocks] long. Returns [t, H, D]."""
    t, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    length = context_start + t
    n_all = _cdiv(length, tile)
    blocks = block_ids[: n_all * (tile // bs)]
    if len(blocks) < n_all * (tile // bs):  # the last tile past the sequence: its first block again (as decode)
        blocks = torch.cat([blocks, blocks[:1].expand(n_all * (tile // bs) - len(blocks))])
    k, v = _gather(k_cache, v_cache, blocks, (n_all, tile))  # [Hkv, n, D, tile], [Hkv, n, tile, D]
    group = h // hkv
    qs = (q.float() * scale).view(t, hkv, group, d).permute(1, 0, 2, 3)  # [Hkv, t, group, D]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    for a in range(0, t, QUERY_ROWS):
        z = min(t, a + QUERY_ROWS)
        n = _cdiv(context_start + z, tile)  # tiles past the pass's last row are all masked: left out
        rows = qs[:, a:z].reshape(hkv, 1, (z - a) * group, d)
        qpos = torch.arange(context_start + a, context_start + z, device=q.device).repeat_interleave(group)
        first = (context_start + a) // tile  # tiles before it lie wholly before every row of the pass
        kpos = torch.arange(first * tile, n * tile, device=q.device).view(n - first, 1, tile)
        m, sums, acc = _tiles(rows, k[:, :n], v[:, :n], qpos.view(1, 1, -1, 1), kpos, first)
        out[a:z] = _merge(m, sums, acc).view(hkv, z - a, group, d).permute(1, 0, 2, 3).reshape(z - a, h, d)
    return out


def _tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
           first_masked: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile: max score, sum of exponentials and weighted values of each row.

    q [..., 1, R, D] (scaled), k [..., n, D, tile], v [..., n, tile, D]; a key of tile >= first_masked counts
    only where kpos <= qpos (kpos [n - first_masked, 1, tile], qpos broadcast against [..., R, 1]).
    Returns m [..., n, R], sums [..., n, R], acc [..., n, R, D]."""
    s = _matmul(q, k)  # [..., n, R, tile]
    if first_masked < s.shape[-3]:
        s[..., first_masked:, :, :].masked_fill_(kpos > qpos, float("-inf"))
    m = s.amax(-1)  # [..., n, R]; -inf where a tile holds nothing the row may see
    s.sub_(m.clamp(min=_NEG).unsqueeze(-1)).exp_()  # such a tile: exp(-inf) = 0 everywhere, no NaN
    return m, s.sum(-1), _matmul(s, v)


def _merge(m: torch.Tensor, sums: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Merge tiles left to right: [..., R, D]. Tiles a row could not see add exact zeros."""
    w = torch.exp(m - m.amax(-2, keepdim=True))  # [..., n, R]
    total = w[..., 0, :] * sums[..., 0, :]
    out = w[..., 0, :, None] * acc[..., 0, :, :]
    for j in range(1, m.shape[-2]):
        total = total + w[..., j, :] * sums[..., j, :]
        out = out + w[..., j, :, None] * acc[..., j, :, :]
    return out / total.unsqueeze(-1)


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
            shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """These blocks of a layer's K and V, float32, head-major, cut into `shape` (..., tiles, tile): K transposed
    [Hkv, ..., D, tile] and V [Hkv, ..., tile, D], both contiguous (a transposed view would take the math library
    down paths whose sums follow the number of rows)."""
    d = k_cache.shape[-1]
    k = k_cache.index_select(0, block_ids).view(*shape, -1, d)  # whole blocks: [..., tile, Hkv, D]
    v = v_cache.index_select(0, block_ids).view(*shape, -1, d)
    nd = len(shape)
    k = k.permute(nd, *range(nd - 1), nd + 1, nd - 1)
    v = v.permute(nd, *range(nd - 1), nd - 1, nd + 1)
    return k.float().contiguous(), v.float().contiguous()


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with at least MIN_ROWS rows (the last one repeated, the copies cut after): a short product takes
    another kernel of the math library, which reduces in another order than the one every longer product takes."""
    m = a.shape[-2]
    if m < MIN_ROWS:
        return torch.matmul(pad_rows(a, MIN_ROWS), b)[..., :m, :]
    return torch.matmul(a, b)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _cdiv_t(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a + b - 1, b, rounding_mode="floor")
