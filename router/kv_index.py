"""The global KV block index a gateway keeps in memory: block hash -> the workers holding it (in their own KV
memory, tier `gpu`), plus the blocks held in the shared KV pool (tier `pool`).

Each worker instance (name + instance id) gets a slot; a block's holders are a bitmask of slots, so matching a
prompt is one dict lookup per block and a few integer operations. A worker instance that leaves (lease expired,
restarted under a new instance id, all cleared) has its slot's blocks removed at once. Plain Python, no I/O.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from splitserve.common.redis_wire import KVEventRecord


@dataclass
class _Slot:
    index: int
    worker: str
    instance_id: str
    hashes: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Match:
    """What one worker holds of a prompt's prefix, in blocks."""

    gpu: int  # leading blocks in the worker's own KV memory
    pool: int  # further leading blocks it could load from the KV pool


class KVIndex:
    def __init__(self) -> None:
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._by_index: dict[int, _Slot] = {}
        self._free_indices: list[int] = []
        self._next_index = 0
        self.gpu: dict[int, int] = {}  # block hash -> bitmask of slots holding it
        self.pool: set[int] = set()  # block hashes in the KV pool
        self.events_applied = 0  # block-level events (one per hash, or one per clear)
        self.events_skipped = 0
        self._slots_version = 0  # changes whenever a slot is made or freed (invalidates _asked)
        self._asked: tuple = ((), -1, {}, 0)  # the last match()'s workers: (pairs, version, slot -> name, mask)

    # -- membership of the index -------------------------------------------------------------------------
    def _slot(self, worker: str, instance_id: str) -> _Slot:
        key = (worker, instance_id)
        slot = self._slots.get(key)
        if slot is None:
            index = self._free_indices.pop() if self._free_indices else self._next_index
            if index == self._next_index:
                self._next_index += 1
            slot = _Slot(index, worker, instance_id)
            self._slots[key] = slot
            self._by_index[index] = slot
            self._slots_version += 1
        return slot

    def _drop(self, slot: _Slot) -> None:
        clear = ~(1 << slot.index)
        gpu = self.gpu
        for h in slot.hashes:
            m = gpu.get(h, 0) & clear
            if m:
                gpu[h] = m
            else:
                gpu.pop(h, None)
        slot.hashes = set()

    def forget(self, worker: str, instance_id: str | None = None) -> int:
        """Remove a worker's entries (every instance of it, or one); returns the blocks removed."""
        removed = 0
        for key in [k for k in self._slots if k[0] == worker and (instance_id is None or k[1] == instance_id)]:
            slot = self._slots.pop(key)
            removed += len(slot.hashes)
            self._drop(slot)
            del self._by_index[slot.index]
            self._free_indices.append(slot.index)
            self._slots_version += 1
        return removed

    def retain(self, live: dict[str, str]) -> int:
        """Keep only the worker instances in `live` (name -> instance id); returns the blocks removed."""
        removed = 0
        for worker, instance in list(self._slots):
            if live.get(worker) != instance:
                removed += self.forget(worker, instance)
        return removed

    def workers(self) -> dict[str, str]:
        return {w: i for w, i in self._slots}

    def blocks_per_worker(self) -> dict[tuple[str, str], int]:
        """(worker, instance id) -> blocks indexed for it."""
        return {key: len(slot.hashes) for key, slot in self._slots.items()}

    # -- events ---------------------------------------------------------------------------------------------
    def apply(self, rec: KVEventRecord, live: dict[str, str] | None = None) -> bool:
        """Apply one event record; False (skipped) when it comes from an instance that is not the live one."""
        if live is not None and rec.worker in live and live[rec.worker] != rec.instance_id:
            self.events_skipped += 1
            return False
        n = len(rec.hashes)
        if rec.tier == "pool":
            hashes = rec.hashes.tolist()
            if rec.kind == "stored":
                self.pool.update(hashes)
            elif rec.kind == "removed":
                self.pool.difference_update(hashes)
            else:
                self.pool.clear()
            self.events_applied += max(1, n)
            return True
        slot = self._slot(rec.worker, rec.instance_id)
        bit = 1 << slot.index
        gpu = self.gpu
        if rec.kind == "stored":
            hashes = rec.hashes.tolist()
            slot.hashes.update(hashes)
            for h in hashes:
                gpu[h] = gpu.get(h, 0) | bit
        elif rec.kind == "removed":
            hashes = rec.hashes.tolist()
            slot.hashes.difference_update(hashes)
            clear = ~bit
            for h in hashes:
                m = gpu.get(h, 0) & clear
                if m:
                    gpu[h] = m
                else:
                    gpu.pop(h, None)
        else:
            self._drop(slot)
        self.events_applied += max(1, n)
        return True

    # -- queries --------------------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[int], workers: Iterable[tuple[str, str]]) -> tuple[dict[str, Match], int]:
        """For each (worker, instance id) asked: how many leading blocks of the prompt it holds, and how many
        more it could load from the pool; and the pool's own leading blocks.

        The hot path of every kv_aware decision (512 lookups for an 8k-token prompt): one dict lookup and one
        AND per block while every asked worker still holds the prefix, bit twiddling only when one drops out."""
        pool = self.pool
        pool_prefix = 0
        if pool:
            for h in block_hashes:
                if h not in pool:
                    break
                pool_prefix += 1
        wanted, alive = self._wanted(workers)
        lengths = dict.fromkeys(wanted.values(), 0)
        if alive:
            get = self.gpu.get
            for n, h in enumerate(block_hashes):
                hit = get(h, 0) & alive
                if hit != alive:
                    gone = alive ^ hit  # the workers whose prefix ends at block n
                    while gone:
                        low = gone & -gone
                        lengths[wanted[low.bit_length() - 1]] = n
                        gone ^= low
                    alive = hit
                    if not alive:
                        break
            n = len(block_hashes)
            while alive:
                low = alive & -alive
                lengths[wanted[low.bit_length() - 1]] = n
                alive ^= low
        made: dict[int, Match] = {}  # one Match per distinct length: most workers share a few
        out = {}
        for w, g in lengths.items():
            m = made.get(g)
            if m is None:
                m = made[g] = Match(g, max(0, pool_prefix - g))
            out[w] = m
        return out, pool_prefix

    def _wanted(self, workers: Iterable[tuple[str, str]]) -> tuple[dict[int, str], int]:
        """The asked workers' slots (slot index -> worker name) and their bitmask; the gateway asks about the same
        workers request after request, so the last answer is kept until the workers or the slots change."""
        pairs = tuple(workers)
        last, version, wanted, alive = self._asked
        if version == self._slots_version and last == pairs:
            return wanted, alive
        wanted = {}
        for worker, instance in pairs:
            slot = self._slots.get((worker, instance))
            if slot is not None:
                wanted[slot.index] = worker
        alive = 0
        for index in wanted:
            alive |= 1 << index
        self._asked = (pairs, self._slots_version, wanted, alive)
        return wanted, alive

    # -- size and snapshots -----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.gpu)

    def memory_bytes(self) -> int:
        """An estimate of the index's memory: the dicts and sets and the integers in them."""
        per_int = 32
        total = sys.getsizeof(self.gpu) + len(self.gpu) * 2 * per_int + sys.getsizeof(self.pool) + len(self.pool) * per_int
        for slot in self._slots.values():
            total += sys.getsizeof(slot.hashes) + len(slot.hashes) * per_int
        return total

    def sections(self) -> list[tuple[str, str, str, np.ndarray]]:
        """The index as snapshot sections: (worker, instance id, tier, hashes)."""
        out = [(s.worker, s.instance_id, "gpu", np.fromiter(s.hashes, np.uint64, len(s.hashes)))
               for s in self._slots.values()]
        if self.pool:
            out.append(("pool", "pool", "pool", np.fromiter(self.pool, np.uint64, len(self.pool))))
        return out

    def load_sections(self, sections: Sequence[tuple[str, str, str, np.ndarray]]) -> None:
        """Replace the index's contents with a snapshot's."""
        self.__init__()
        for worker, instance, tier, hashes in sections:
            self.apply(KVEventRecord(worker, instance, "stored", tier, hashes))
