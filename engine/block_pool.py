"""The KV block pool: free list (LRU), reference counts and the prefix-cache hash map. Plain Python.

Free blocks sit in one queue ordered by eviction priority (head = evicted first). A freed block that holds
a cached prefix keeps its hash until it is handed out again, so a later request can still hit it; handing
it out evicts it and reports a `BlockRemoved` event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "KVCacheEvent", "NoFreeBlocksError"]


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        on_event: Callable[[KVCacheEvent], None] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_event = on_event
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` blocks with refcount 1, evicting cached ones from the LRU head."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self.free_queue)} free")
        out = []
        removed = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[block_id]
            if h is not None:
                self.block_hash[block_id] = None
                if self.cached.get(h) == block_id:
                    del self.cached[h]
                    removed.append(h)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        if removed and self.on_event:
            self.on_event(BlockRemoved(removed))
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (prefix hit); unreferenced ones leave the free queue."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue's tail in the given order."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def lookup(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes`."""
        hits = []
        if not self.enable_caching:
            return hits
        for h in block_hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Register full, computed blocks under their hashes (a hash already cached keeps its block)."""
        if not self.enable_caching:
            return
        stored = []
        for b, h in zip(block_ids, block_hashes, strict=True):
            if self.block_hash[b] is not None:
                continue
            if h in self.cached:
                continue  # the same content computed twice concurrently: keep the first
            self.block_hash[b] = h
            self.cached[h] = b
            stored.append(h)
        if stored and self.on_event:
            self.on_event(BlockStored(stored, parent_hash, list(token_ids), block_size))

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped."""
        dropped = [h for h, b in self.cached.items() if self.ref_cnt[b] == 0]
        for h in dropped:
            b = self.cached.pop(h)
            self.block_hash[b] = None
        if self.on_event:
            self.on_event(AllBlocksCleared() if not self.cached else BlockRemoved(dropped))
        return len(dropped)
