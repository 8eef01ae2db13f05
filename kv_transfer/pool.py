"""The Redis-backed KV pool: KV blocks stored by chained block hash, so they outlive a worker's memory and move
between workers.

Writes are write-behind: the engine's KV events name the blocks a worker computed; a bounded queue (never
waited on: overflow drops blocks, counted) feeds a task that copies a few blocks at a time out of the KV cache
between engine steps, skips those already in the pool, and stores the rest (header + checksum, one SET each,
pipelined), then tells the gateways (`pool` tier events on the model's KV event stream).

Reads: before a prompt is computed, its blocks beyond the worker's own cache are looked up; when enough are in
the pool (and loading is estimated cheaper than computing), the request's blocks are reserved, the pool's
leading run is read and checked (a missing or corrupt block ends the run: the rest is computed), written into
the reserved blocks, and the request is admitted with those tokens done. Any Redis failure or a read past its
deadline means computing instead; nothing fails because of the pool. docs/kv_pool.md gives the cost model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

import numpy as np
import torch

from splitserve.common.config import ClusterSpec, KVPoolSpec
from splitserve.common.hashing import hash_token_blocks
from splitserve.common.kv_events import BlockStored, KVCacheEvent
from splitserve.common.pool_metrics import (
    BLOCKS_SKIPPED,
    BLOCKS_WRITTEN,
    BYTES_READ,
    BYTES_WRITTEN,
    ERROR_REASONS,
    ERRORS,
    HIT_TOKENS,
    LOOKUP_TOKENS,
    POOL_BYTES,
    POOL_REDIS_UP,
    READ_SECONDS,
    WRITE_SECONDS,
)
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import ChecksumError, Keys, KVEventRecord, PoolNamespace, WireError
from splitserve.common.sampling import SamplingParams
from splitserve.common.tasks import TaskOwner
from splitserve.common.worker_context import WorkerContext
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.interface import KVEventListener, ModelFacts
from splitserve.engine.outputs import RequestOutput

log = logging.getLogger("splitserve.kv_pool")


class KVPool:
    def __init__(self, spec: KVPoolSpec, link: RedisLink, engine: AsyncEngine, keys: Keys, worker: str,
                 instance_id: str, write: bool) -> None:
        kv = engine.kv_spec
        self.spec = spec
        self.link = link
        self.engine = engine
        self.keys = keys
        self.worker = worker
        self.instance_id = instance_id
        self.block_size = kv.block_size
        self.salt = engine.facts.name
        self.ns = PoolNamespace(engine.facts.name, kv.dtype, kv.block_size, kv.num_layers, kv.num_kv_heads,
                                kv.head_dim)
        self.write_enabled = write
        self._pending: deque[int] = deque()  # block hashes computed here, to write
        self._pending_set: set[int] = set()
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        self._tasks = TaskOwner("kv-pool")  # the writer: a failure is logged, never left unobserved
        self.read_gbps = 1.0  # measured read bandwidth (EWMA), GB/s: the load-vs-compute estimate
        for reason in ERROR_REASONS:
            ERRORS.labels(reason)

    # == writes ==========================================================================================
    def listener(self, event: KVCacheEvent) -> None:
        """Engine thread: queue the blocks this worker just computed (never blocks; overflow is dropped)."""
        if not self.write_enabled or not isinstance(event, BlockStored):
            return
        with self._lock:
            for h in event.block_hashes:
                if h in self._pending_set:
                    continue
                if len(self._pending) >= self.spec.write_queue_blocks:
                    ERRORS.labels("dropped").inc()
                    continue
                self._pending.append(h)
                self._pending_set.add(h)

    def _take(self, n: int) -> list[int]:
        with self._lock:
            out = [self._pending.popleft() for _ in range(min(n, len(self._pending)))]
            self._pending_set.difference_update(out)
        return out

    def start(self) -> None:
        self._tasks.spawn(self._write_loop(), "writer")

    async def close(self) -> None:
        self.write_enabled = False  # its listener stays on the engine (no removal seam): it queues nothing more
        await self._tasks.close()
        await self.link.close()

    async def _write_loop(self) -> None:
        last_info = 0.0
        while True:
            batch = self._take(self.spec.blocks_per_copy)
            if not batch:
                await asyncio.sleep(0.02)
            else:
                await self.write_blocks(batch)
            if time.monotonic() - last_info > 10:
                last_info = time.monotonic()
                info = await self.link.call(lambda r: r.info("memory"))
                if isinstance(info, dict) and "used_memory" in info:
                    POOL_BYTES.set(info["used_memory"])

    async def write_blocks(self, hashes: Sequence[int]) -> int:
        """Store these of our cached blocks that the pool lacks; returns how many were written."""
        exists = await self.link.call(lambda r: _pipelined(r, [("exists", self.ns.key(h)) for h in hashes]))
        if exists is None:
            ERRORS.labels("redis").inc()
            return 0
        missing = [h for h, e in zip(hashes, exists, strict=True) if not e]
        BLOCKS_SKIPPED.inc(len(hashes) - len(missing))
        if not missing:
            return 0
        found, data = await self.engine.export_blocks(missing)  # copies, between two engine steps
        if not found:
            return 0
        values = await asyncio.to_thread(lambda: [self.ns.encode_block(data[i].numpy().data) for i in range(len(found))])
        ttl = self.spec.ttl_seconds
        record = KVEventRecord(self.worker, self.instance_id, "stored", "pool", np.asarray(found, dtype=np.uint64))

        async def store(r) -> bool:
            from redis.exceptions import OutOfMemoryError

            try:
                await _pipelined(r, [("set", self.ns.key(h), v, ttl) for h, v in zip(found, values, strict=True)])
            except OutOfMemoryError:  # maxmemory reached with nothing left to evict: these blocks stay unpooled
                return False
            await r.xadd(self.keys.events, record.encode(), maxlen=200_000, approximate=True)
            return True

        t0 = time.monotonic()
        stored = await self.link.call(store, False)
        WRITE_SECONDS.inc(time.monotonic() - t0)
        if not stored:
            ERRORS.labels("redis").inc()
            return 0
        BLOCKS_WRITTEN.inc(len(found))
        BYTES_WRITTEN.inc(sum(len(v) for v in values))
        return len(found)

    # == reads ===========================================================================================
    def worth_loading(self, tokens: int) -> bool:
        """The cost model: load at least `min_load_tokens`, and (when the prefill speed is known) only when
        reading the bytes is estimated faster than computing the tokens."""
        if tokens < self.spec.min_load_tokens:
            return False
        if self.spec.prefill_tokens_per_second is None:
            return True
        load_s = tokens / self.block_size * self.ns.payload_bytes / (self.read_gbps * 1e9)
        return load_s < tokens / self.spec.prefill_tokens_per_second

    async def _leading_in_pool(self, hashes: Sequence[int]) -> int:
        exists = await self.link.call(lambda r: _pipelined(r, [("exists", self.ns.key(h)) for h in hashes]))
        if exists is None:
            return 0
        n = 0
        for e in exists:
            if not e:
                break
            n += 1
        return n

    async def _read(self, hashes: Sequence[int]) -> torch.Tensor:
        """The leading run of these blocks that is in the pool and intact, as [n, bytes per block]."""
        t0 = time.monotonic()
        raws = await self.link.call(lambda r: _pipelined(r, [("get", self.ns.key(h)) for h in hashes]))
        if raws is None:
            ERRORS.labels("redis").inc()
            return torch.empty((0, self.ns.payload_bytes), dtype=torch.uint8)

        def check() -> list[memoryview]:
            good = []
            for raw in raws:
                if raw is None:
                    ERRORS.labels("missing").inc()  # evicted since we looked: the rest is computed
                    break
                try:
                    good.append(self.ns.decode_block(raw))
                except ChecksumError:
                    ERRORS.labels("checksum").inc()
                    break
                except WireError:
                    ERRORS.labels("header").inc()
                    break
            return good

        good = await asyncio.to_thread(check)
        out = np.empty((len(good), self.ns.payload_bytes), dtype=np.uint8)
        for i, payload in enumerate(good):
            out[i] = np.frombuffer(payload, dtype=np.uint8)
        nbytes = len(good) * self.ns.payload_bytes
        BYTES_READ.inc(nbytes)
        elapsed = time.monotonic() - t0
        READ_SECONDS.inc(elapsed)
        if nbytes and elapsed > 0:
            self.read_gbps = 0.8 * self.read_gbps + 0.2 * nbytes / elapsed / 1e9
        return torch.from_numpy(out)

    async def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams, priority: int = 0,
                       hold_blocks: bool = False) -> AsyncIterator[RequestOutput]:
        """The engine's `generate`, loading the prompt's blocks from the pool first where that pays."""
        stream = await self._try_load(request_id, prompt, params, priority, hold_blocks)
        if stream is None:
            stream = self.engine.generate(request_id, prompt, params, priority, hold_blocks)
        async for out in stream:
            yield out

    async def _try_load(self, request_id: str, prompt: Sequence[int], params: SamplingParams, priority: int,
                        hold_blocks: bool) -> AsyncIterator[RequestOutput] | None:
        if not self.link.up:
            return None
        bs = self.block_size
        hashes = hash_token_blocks(prompt[: (len(prompt) - 1) // bs * bs], bs, self.salt)  # leave one to compute
        if not hashes or not self.worth_loading(len(hashes) * bs):
            return None
        try:
            async with asyncio.timeout(self.spec.read_timeout_seconds):
                in_pool = await self._leading_in_pool(hashes)
                if not self.worth_loading(in_pool * bs):
                    return None
                reserved = await self.engine.reserve_remote(request_id, prompt, params, priority, hold_blocks)
                if reserved is None:
                    return None
                _, cached = reserved
                local = cached // bs
                LOOKUP_TOKENS.inc(max(0, len(hashes) - local) * bs)
                data = await self._read(hashes[local:in_pool]) if in_pool > local and self.worth_loading(
                    (in_pool - local) * bs) else None
        except TimeoutError:
            ERRORS.labels("timeout").inc()
            await self.engine.abort(request_id)
            return None
        if data is None or not len(data):
            await self.engine.abort(request_id)
            return None
        HIT_TOKENS.inc(len(data) * bs)
        return self.engine.stream_loaded(request_id, local, data)


class PooledEngine:
    """The native engine as a role serves it with a KV pool (`ServingEngine`): `generate` loads the prompt's
    blocks from the pool first where that pays; everything else is the engine's."""

    def __init__(self, engine: AsyncEngine, pool: KVPool) -> None:
        self.engine = engine
        self.pool = pool

    @property
    def facts(self) -> ModelFacts:
        return self.engine.facts

    @property
    def dead(self) -> bool:
        return self.engine.dead

    def add_kv_event_listener(self, listener: KVEventListener) -> None:
        self.engine.add_kv_event_listener(listener)

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        return self.pool.generate(request_id, prompt_token_ids, params, priority)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()


async def _pipelined(r, ops: list[tuple]) -> list:
    """Run (command, key, ...) operations in one pipeline (keys may live on any Redis Cluster node)."""
    pipe = r.pipeline(transaction=False)
    for op in ops:
        if op[0] == "exists":
            pipe.exists(op[1])
        elif op[0] == "get":
            pipe.get(op[1])
        elif op[0] == "set":
            pipe.set(op[1], op[2], ex=op[3])
    return await pipe.execute()


async def make_pool(spec: ClusterSpec, engine: AsyncEngine, ctx: WorkerContext, role: str) -> KVPool | None:
    """The worker's KV pool when `kvPool.enabled` and there is a Redis; started, its writer listening to the
    engine's KV events. None otherwise (and with tensor parallelism, whose shards it does not store yet).

    The pool has a Redis link of its own to the worker's Redis, whose socket deadline is
    `kvPool.readTimeoutSeconds`: its reads and writes move megabytes, which on a loaded host can take longer
    than the 1 s the worker's own link allows its small calls; one slow read must not take the registry's
    lease down with it, nor wait behind it."""
    if not spec.kv_pool.enabled:
        return None
    if ctx.link is None:
        log.warning("kvPool.enabled needs Redis (redis.mode bundled or external): the KV pool is off")
        return None
    if engine.facts.tensor_parallel_size > 1:
        log.warning("the KV pool does not store tensor-parallel shards yet: it is off on this worker")
        return None
    link = RedisLink(ctx.link.url, timeout=spec.kv_pool.read_timeout_seconds, name="kv pool redis",
                     up_gauge=POOL_REDIS_UP)
    await link.start()  # not reachable yet: the pool computes everything until its link is up
    pool = KVPool(spec.kv_pool, link, engine, ctx.keys, ctx.name, ctx.instance_id,
                  write=role in spec.kv_pool.write_from)
    engine.add_kv_event_listener(pool.listener)
    pool.start()
    return pool
