"""The KV cache memory an agent registers: per layer one K and one V tensor `[num_blocks, block_size, kv_heads,
head_dim]`, so block b of a layer is the byte range [b * block_bytes, (b + 1) * block_bytes) of that tensor, and
token t of it holds this rank's heads back to back (token_bytes), head i at i * head_bytes within the token.

Under tensor parallelism the tensors hold a shard of the heads (`shard`): global heads head_start ..
head_start + num_heads - 1 of the model's num_kv_heads; a slab of heads of one token is contiguous, a slab of
heads of one block is block_size strided pieces (the movers' problem when the two sides shard differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.parallel import KVShard


@dataclass
class KVLayout:
    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V)
    shard: KVShard | None = None  # None: one rank holding every head

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("KV layout needs at least one layer")
        heads = self.tensors[0][0].shape[2]
        if self.shard is None:
            self.shard = KVShard(0, 1, 0, heads, heads)
        if self.shard.num_heads != heads:
            raise ValueError(f"KV shard says {self.shard.num_heads} heads, the tensors hold {heads}")
        k0 = self.tensors[0][0]
        for k, v in self.tensors:
            if k.shape != k0.shape or v.shape != k0.shape or k.dtype != k0.dtype or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError("every layer's K and V must be contiguous tensors of one shape and dtype")

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    @property
    def num_blocks(self) -> int:
        return self.tensors[0][0].shape[0]

    @property
    def block_bytes(self) -> int:  # bytes of one block of K (or V) in one layer
        k = self.tensors[0][0]
        return k[0].numel() * k.element_size()

    @property
    def block_size(self) -> int:  # tokens per block
        return self.tensors[0][0].shape[1]

    @property
    def num_heads(self) -> int:  # KV heads in this rank's tensors
        return self.tensors[0][0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.tensors[0][0].shape[3]

    @property
    def head_bytes(self) -> int:  # bytes of one head of one token
        k = self.tensors[0][0]
        return self.head_dim * k.element_size()

    @property
    def token_bytes(self) -> int:  # bytes of one token of K (or V) in one layer: every head here
        return self.num_heads * self.head_bytes

    @property
    def dtype(self) -> str:
        return str(self.tensors[0][0].dtype).removeprefix("torch.")

    @property
    def device(self) -> torch.device:
        return self.tensors[0][0].device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def byte_view(self, layer: int, kv: int) -> torch.Tensor:
        """The layer's K (kv=0) or V (kv=1) tensor as flat uint8."""
        return self.tensors[layer][kv].view(-1).view(torch.uint8)

    def heads_view(self, layer: int, kv: int, start: int, count: int) -> torch.Tensor:
        """[num_blocks, block_size, count, head_dim]: heads start..start+count-1 of this rank's shard (a view)."""
        return self.tensors[layer][kv][:, :, start : start + count]

    def describe(self) -> dict:
        return {"num_layers": self.num_layers, "block_bytes": self.block_bytes, "dtype": self.dtype,
                "num_blocks": self.num_blocks, "block_size": self.block_size, "head_dim": self.head_dim,
                "kv_heads": [self.shard.head_start, self.shard.num_heads, self.shard.num_kv_heads],
                "rank": self.shard.rank, "world_size": self.shard.world_size}


def coalesce(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair source and destination blocks into runs (src_start, dst_start, n) contiguous on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if runs:
            rs, rd, n = runs[-1]
            if s == rs + n and d == rd + n:
                runs[-1] = (rs, rd, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
