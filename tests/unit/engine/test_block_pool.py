"""Block-pool properties under random sequences of allocate / share / free / cache / evict (hypothesis)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.engine.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    NoFreeBlocksError,
)

NUM_BLOCKS = 12


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.events: list = []
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, on_event=self.events.append)
        self.owners: list[list[int]] = []  # each: the blocks one holder references
        self.next_hash = 1

    @rule(n=st.integers(1, 5))
    def allocate(self, n: int) -> None:
        free = self.pool.num_free_blocks
        if n > free:
            try:
                self.pool.allocate(n)
            except NoFreeBlocksError:
                assert self.pool.num_free_blocks == free  # nothing changed
                return
            raise AssertionError("allocate beyond the free count must fail")
        self.owners.append(self.pool.allocate(n))

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def share(self, i: int) -> None:
        blocks = self.owners[i % len(self.owners)]
        self.pool.touch(blocks)
        self.owners.append(list(blocks))

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        blocks = self.owners.pop(i % len(self.owners))
        self.pool.free(reversed(blocks))

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def cache(self, i: int) -> None:
        blocks = self.owners[i % len(self.owners)]
        hashes = list(range(self.next_hash, self.next_hash + len(blocks)))
        self.next_hash += len(blocks)
        self.pool.cache_blocks(blocks, hashes, None, [0] * len(blocks), 1)

    @rule(i=st.integers(0, 10**6))
    def hit(self, i: int) -> None:
        """A prefix-cache hit on some cached block (evictable or in use) takes a reference."""
        if not self.pool.cached:
            return
        hashes = sorted(self.pool.cached)
        h = hashes[i % len(hashes)]
        blocks = self.pool.lookup([h])
        assert len(blocks) == 1 and self.pool.block_hash[blocks[0]] == h
        self.pool.touch(blocks)
        self.owners.append(blocks)

    @rule()
    def reset(self) -> None:
        self.pool.reset_prefix_cache()

    @invariant()
    def refcounts_match_owners(self) -> None:
        expected = [0] * NUM_BLOCKS
        for blocks in self.owners:
            for b in blocks:
                expected[b] += 1
        assert self.pool.ref_cnt == expected

    @invariant()
    def free_queue_is_exactly_unreferenced(self) -> None:
        free = set(self.pool.free_queue)
        assert len(free) == len(self.pool.free_queue)
        assert free == {b for b in range(NUM_BLOCKS) if self.pool.ref_cnt[b] == 0}  # no leak, no loss

    @invariant()
    def cache_map_consistent(self) -> None:
        for h, b in self.pool.cached.items():
            assert self.pool.block_hash[b] == h
        live = {b for b in range(NUM_BLOCKS) if self.pool.block_hash[b] is not None}
        assert live == set(self.pool.cached.values())

    @invariant()
    def events_replay_to_cache(self) -> None:
        """Replaying stored/removed events reproduces the cache's key set (what the router's index sees)."""
        seen: set[int] = set()
        for e in self.events:
            if isinstance(e, BlockStored):
                seen.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                seen.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                seen.clear()
        assert seen == set(self.pool.cached)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPool = PoolMachine.TestCase


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    try:
        pool.free([b])
    except RuntimeError as e:
        assert "double free" in str(e)
    else:
        raise AssertionError("double free was not detected")


def test_lru_evicts_oldest_freed_cached_block_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_blocks([a, b, c], [11, 12, 13], None, [1, 2, 3], 1)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    (x,) = pool.allocate(1)
    assert x == b and 12 not in pool.cached and 11 in pool.cached


def test_block_pool_has_no_torch_import() -> None:
    """The block pool, KV cache manager and scheduler are plain Python."""
    import ast
    import inspect

    import splitserve.engine.block_pool as bp
    import splitserve.engine.kv_cache_manager as kvm
    import splitserve.engine.scheduler as sch

    for mod in (bp, kvm, sch):
        tree = ast.parse(inspect.getsource(mod))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(n.split(".")[0] == "torch" for n in names), mod.__name__
