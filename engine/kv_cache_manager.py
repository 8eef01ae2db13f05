"""Per-request block tables on top of the block pool, with prefix-cache lookup. Plain Python."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.hashing import hash_token_blocks
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, salt: str = "") -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.salt = salt
        self.req_to_blocks: dict[str, list[int]] = {}
        self.req_to_hashes: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already registered

    def block_hashes(self, request: Request) -> list[int]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        num_full = request.num_tokens // bs
        if len(hashes) < num_full:
            done = len(hashes)
            hashes += hash_token_blocks(request.token_slice(done * bs, num_full * bs), bs, self.salt,
                                        hashes[-1] if hashes else None)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks covering a prefix of the request, and how many tokens they hold.

        At least one token is always left to compute, so the model produces logits for it.
        """
        if not self.pool.enable_caching:
            return [], 0
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.pool.lookup(hashes[:max_blocks])
        return hits, len(hits) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
                     keep_free: int = 0) -> bool:
        """Whether the pool has room for `num_new_tokens` more tokens and `keep_free` blocks beside them."""
        need = self._num_blocks_needed(request, num_new_tokens, new_computed_blocks)
        return need + keep_free <= self.pool.num_free_blocks

    def _num_blocks_needed(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int]) -> int:
        have = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        needed = max(0, cdiv(total, self.block_size) - have)
        evictable_hits = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        return needed + evictable_hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (), keep_free: int = 0
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens, leaving at least `keep_free` blocks free; None when the
        pool cannot (nothing changes then)."""
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks, keep_free):
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        extra = cdiv(total, self.block_size) - len(blocks)
        if extra > 0:
            blocks.extend(self.pool.allocate(extra))
        return blocks

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly full and computed blocks in the prefix cache."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        done = self.num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        hashes = self.block_hashes(request)
        bs = self.block_size
        self.pool.cache_blocks(
            blocks[done:num_full],
            hashes[done:num_full],
            hashes[done - 1] if done else None,
            request.token_slice(done * bs, num_full * bs),
            bs,
        )
        self.num_cached_blocks[rid] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self.req_to_hashes.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def reset_hashes(self, request_id: str) -> None:
        self.req_to_hashes.pop(request_id, None)
