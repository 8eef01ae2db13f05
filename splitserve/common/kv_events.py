"""KV block events: what a worker's cache reports (stored, removed, all cleared), and the publisher that sends
them to the model's Redis stream for the gateways' global index.

The engine calls the publisher's listener on its own thread for every event; the listener only appends to a
bounded in-memory queue and updates a mirror of the worker's cached block hashes, so it never blocks a step.
An asyncio task batches the queue into stream entries. When Redis is slow or down and the queue overflows, the
queue is dropped and, once Redis answers again, the worker republishes its whole cache from the mirror
(`cleared`, then `stored`), so the index converges instead of drifting.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from splitserve.common.redis_wire import MAX_HASHES_PER_EVENT, Keys, KVEventRecord

log = logging.getLogger("splitserve.kv_events")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block is gone (the prefix cache was reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventPublisher:
    """One worker's events to `Keys(model).events` (a Redis stream, trimmed to about `stream_len` entries)."""

    def __init__(self, redis_fn, keys: Keys, worker: str, instance_id: str, tier: str = "gpu",
                 max_pending: int = 65536, interval: float = 0.05, stream_len: int = 200_000) -> None:
        self.redis_fn = redis_fn  # () -> a redis.asyncio client, or None while Redis is unreachable
        self.keys = keys
        self.worker = worker
        self.instance_id = instance_id
        self.tier = tier
        self.max_pending = max_pending  # block hashes queued at most before the queue is dropped
        self.interval = interval  # seconds between batches
        self.stream_len = stream_len
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, list[int], int]] = deque()  # (kind, hashes, parent)
        self._queued = 0
        self._mirror: set[int] = set()  # the worker's cached block hashes, as events told
        self._resync = True  # first publish: clear whatever a previous instance of this name left
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.published = 0  # block hashes sent
        self.dropped = 0  # block hashes dropped on overflow (a resync follows)

    # -- engine thread ----------------------------------------------------------------------------------
    def listener(self, event: KVCacheEvent) -> None:
        with self._lock:
            if isinstance(event, BlockStored):
                self._mirror.update(event.block_hashes)
                item = ("stored", list(event.block_hashes), event.parent_block_hash or 0)
            elif isinstance(event, BlockRemoved):
                self._mirror.difference_update(event.block_hashes)
                item = ("removed", list(event.block_hashes), 0)
            else:
                self._mirror.clear()
                item = ("cleared", [], 0)
            if self._resync:
                return  # the resync publishes the mirror as it will be then
            self._queued += len(item[1]) or 1
            if self._queued > self.max_pending:  # Redis is not keeping up: publish the whole state later
                self.dropped += self._queued
                self._queue.clear()
                self._queued = 0
                self._resync = True
                return
            self._queue.append(item)

    def resync(self) -> None:
        """Republish the whole cache at the next flush (Redis came back, perhaps empty)."""
        with self._lock:
            self._resync = True

    # -- publishing ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def _take(self) -> list[KVEventRecord] | None:
        """The records to send now (None: nothing); a resync takes the mirror instead of the queue."""
        with self._lock:
            if self._resync:  # the whole cache now; events after this moment queue behind it
                self._queue.clear()
                self._queued = 0
                self._resync = False
                hashes = np.fromiter(self._mirror, dtype=np.uint64, count=len(self._mirror))
                resync = True
            elif not self._queue:
                return None
            else:
                items = list(self._queue)
                self._queue.clear()
                self._queued = 0
                resync = False
        if resync:
            records = [self._record("cleared", np.empty(0, np.uint64))]
            for i in range(0, len(hashes), MAX_HASHES_PER_EVENT):
                records.append(self._record("stored", hashes[i : i + MAX_HASHES_PER_EVENT]))
            return records
        return [self._record(kind, np.asarray(h, dtype=np.uint64), parent) for kind, h, parent in _merge(items)]

    def _record(self, kind: str, hashes: np.ndarray, parent: int = 0) -> KVEventRecord:
        return KVEventRecord(self.worker, self.instance_id, kind, self.tier, hashes, parent)

    async def flush(self) -> bool:
        """Send what is queued; False (and a resync later) if Redis failed."""
        records = self._take()
        if records is None:
            return True
        r = self.redis_fn()
        try:
            if r is None:
                raise ConnectionError("redis unreachable")
            pipe = r.pipeline(transaction=False)
            for rec in records:
                pipe.xadd(self.keys.events, rec.encode(), maxlen=self.stream_len, approximate=True)
            await pipe.execute()
        except Exception as e:  # noqa: BLE001 - any Redis failure: resync when it is back
            with self._lock:
                self._resync = True
            log.debug("kv events not published (%s); the whole cache will be republished", e)
            return False
        self.published += sum(len(rec.hashes) for rec in records)
        return True

    async def _run(self) -> None:
        backoff = self.interval
        while True:
            ok = await self.flush()
            backoff = self.interval if ok else min(2.0, backoff * 2)
            await asyncio.sleep(backoff)


def _merge(items: list[tuple[str, list[int], int]]) -> list[tuple[str, list[int], int]]:
    """Adjacent events of one kind become one record (a merged `stored` keeps the first one's parent: the
    index keys blocks by their chained hash alone, so parents are informational)."""
    out: list[tuple[str, list[int], int]] = []
    for kind, hashes, parent in items:
        if out and out[-1][0] == kind and kind != "cleared" and len(out[-1][1]) + len(hashes) <= MAX_HASHES_PER_EVENT:
            out[-1][1].extend(hashes)
        else:
            out.append((kind, list(hashes), parent))
    return out
