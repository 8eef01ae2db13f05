"""The KV pool's counters of a vLLM worker, on the worker's /metrics: the pool connector runs inside vLLM's
processes and adds its counts to a small Redis hash per server (`Keys.pool_stats`, flushed about once a
second); the worker reads that hash and advances the same `splitserve_kv_pool_*` counters a native worker
exposes. The first reading is the baseline (a hash left by an earlier server of this name counts nothing); the
worker deletes the hash when it stops."""

from __future__ import annotations

import asyncio
import logging

from splitserve.common import pool_metrics as m
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import Keys

log = logging.getLogger("splitserve.vllm")

POLL_S = 1.0
MEMORY_POLL_S = 10.0

_COUNTERS = {"hit_tokens": m.HIT_TOKENS, "lookup_tokens": m.LOOKUP_TOKENS, "bytes_written": m.BYTES_WRITTEN,
             "bytes_read": m.BYTES_READ, "read_seconds": m.READ_SECONDS, "write_seconds": m.WRITE_SECONDS,
             "blocks_written": m.BLOCKS_WRITTEN, "blocks_skipped": m.BLOCKS_SKIPPED}


class PoolStatsMirror:
    def __init__(self, link: RedisLink, model: str, pool_worker: str) -> None:
        self.link = link
        self.key = Keys(model).pool_stats(pool_worker)
        self._last: dict[str, float] | None = None
        for reason in m.ERROR_REASONS:
            m.ERRORS.labels(reason)

    def apply(self, raw: dict) -> None:
        """One reading of the hash: advance each counter by what it grew since the last reading."""
        now: dict[str, float] = {}
        for k, v in raw.items():
            try:
                now[k.decode() if isinstance(k, bytes) else str(k)] = float(v)
            except (TypeError, ValueError):
                continue  # not a number: not ours to count
        last, self._last = self._last, now
        if last is None:
            return
        for name, value in now.items():
            delta = value - last.get(name, 0.0)
            if delta <= 0:
                continue
            if name in _COUNTERS:
                _COUNTERS[name].inc(delta)
            elif name.startswith("errors_") and name[7:] in m.ERROR_REASONS:
                m.ERRORS.labels(name[7:]).inc(delta)

    async def run(self) -> None:
        await self.link.start()
        since_memory = MEMORY_POLL_S
        try:
            while True:
                raw = await self.link.call(lambda r: r.hgetall(self.key))
                if isinstance(raw, dict):
                    self.apply(raw)
                since_memory += POLL_S
                if since_memory >= MEMORY_POLL_S:
                    since_memory = 0.0
                    info = await self.link.call(lambda r: r.info("memory"))
                    if isinstance(info, dict) and "used_memory" in info:
                        m.POOL_BYTES.set(info["used_memory"])
                await asyncio.sleep(POLL_S)
        finally:  # the hash goes with its worker (a name is never reused: it would only pile up)
            await self.link.call(lambda r: r.delete(self.key))
            await self.link.close()
