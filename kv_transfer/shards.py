"""Who sends which KV heads to whom when a prefill worker at tensor-parallel size p streams into a decode worker at
size d (p, d >= 1, p != d allowed).

Each rank holds a contiguous run of KV heads (`splitserve.engine.parallel.kv_head_range`): an equal split, or,
with fewer KV heads than ranks, one head shared by consecutive ranks. For every head, the lowest prefill rank
holding it sends it (so a replicated head leaves the prefill worker once) to the lowest decode rank holding it,
its *receiver*; the decode ranks sharing that head copy it from there once it landed (`KVCopy`). Consecutive
heads with the same sender and receiver form one `Route`, moved as one slab of heads per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.parallel import kv_head_range


@dataclass(frozen=True)
class Route:
    src_rank: int  # prefill rank sending
    dst_rank: int  # decode rank receiving
    head_start: int  # first KV head (global index)
    num_heads: int
    src_offset: int  # head_start within the sender's shard
    dst_offset: int  # head_start within the receiver's shard
    num_src: int  # how many senders write into dst_rank for one request (it counts their final writes)


def head_ranges(num_kv_heads: int, world_size: int) -> list[range]:
    return [kv_head_range(num_kv_heads, r, world_size) for r in range(world_size)]


def receivers(num_kv_heads: int, world_size: int) -> list[int]:
    """Decode ranks that receive KV over the wire: the first holder of each head, in rank order."""
    ranges = head_ranges(num_kv_heads, world_size)
    return sorted({next(r for r, heads in enumerate(ranges) if h in heads) for h in range(num_kv_heads)})


def plan_routes(num_kv_heads: int, src_world: int, dst_world: int) -> list[Route]:
    """Every (sender, receiver, run of heads) for one request, ordered by receiver then head."""
    src = head_ranges(num_kv_heads, src_world)
    dst = head_ranges(num_kv_heads, dst_world)
    pairs: list[tuple[int, int, int]] = []  # (src rank, dst rank, head)
    for h in range(num_kv_heads):
        s = next(r for r, heads in enumerate(src) if h in heads)
        d = next(r for r, heads in enumerate(dst) if h in heads)
        pairs.append((s, d, h))
    runs: list[list[int]] = []  # [src, dst, head_start, num_heads]
    for s, d, h in pairs:
        if runs and runs[-1][0] == s and runs[-1][1] == d and runs[-1][2] + runs[-1][3] == h:
            runs[-1][3] += 1
        else:
            runs.append([s, d, h, 1])
    senders = {d: len({s for s, dd, _, _ in runs if dd == d}) for _, d, _, _ in runs}
    return sorted((Route(s, d, h, n, h - src[s].start, h - dst[d].start, senders[d]) for s, d, h, n in runs),
                  key=lambda r: (r.dst_rank, r.head_start))
