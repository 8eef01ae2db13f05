"""Worker membership in Redis: each worker registers itself under a lease, and readers (gateways, decode workers)
keep a view of the live ones.

A worker's entry is a key holding its record; its lease is its score in the model's lease set (an expiry on the
Redis server's clock, a few seconds ahead), refreshed with the record about every second. A worker that stops refreshing drops out of every view when
its lease expires; one that restarts under the same name comes back with a new instance id, which tells
readers to drop whatever they knew of the old one. A draining worker (SIGTERM, scale-down) marks its entry so,
and gets nothing new. A worker that flips its role marks its entry draining while it changes, then rewrites it
under the new role with the same name and instance id (readers keep what they knew of it: its cache is the same). When Redis is unreachable, readers keep their last view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from prometheus_client import Counter

from splitserve.common.membership import WorkerInfo
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import LEASE_SCRIPT, READ_LEASES_SCRIPT, Keys, RegistryEntry, WireError

log = logging.getLogger("splitserve.registry")
REJECTED = Counter("splitserve_registry_entries_rejected", "Registry entries that failed validation", ["reason"])


class Registration:
    """A worker's own entry: written at once, refreshed every `refresh_s`, expiring `lease_s` after the last."""

    def __init__(self, link: RedisLink, keys: Keys, entry: RegistryEntry, lease_s: float = 5.0,
                 refresh_s: float = 1.0, load: Callable[[], dict] | None = None) -> None:
        self.link = link
        self.keys = keys
        self.entry = entry
        self.lease_ms = int(lease_s * 1000)
        self.refresh_s = refresh_s
        self.load = load  # () -> the worker's current load fields
        self.on_lost: Callable[[], Awaitable[None]] | None = None  # the entry vanished (Redis lost its data)
        self._written = False
        self._task: asyncio.Task | None = None

    async def _write(self) -> bool:
        entry = self.entry if self.load is None else replace(self.entry, **self.load())
        raw = entry.encode()

        async def put(r) -> bool:
            existed = await r.eval(LEASE_SCRIPT, 2, self.keys.worker(entry.name), self.keys.workers, entry.name, raw,
                                   self.lease_ms)
            return bool(existed)

        kept = await self.link.call(put, None)
        if kept is None:
            return False
        if not kept and self._written and self.on_lost is not None:
            log.warning("this worker's registry entry was gone (Redis restarted or lost data): republishing")
            await self.on_lost()
        self._written = True
        return True

    async def refresh(self) -> bool:
        """Write the entry now (the lease starts again)."""
        return await self._write()

    async def start(self) -> None:
        await self._write()
        self._task = asyncio.get_running_loop().create_task(self._refresh(), name="registration")

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self._write()

    async def drain(self) -> None:
        """Mark this worker draining in the registry (gateways and peers send it nothing new)."""
        self.entry = replace(self.entry, draining=True)
        await self._write()

    async def serve_as(self, role: str) -> None:
        """A role flip is done: the entry names `role` and takes requests again (written now; if Redis does not
        answer, the next refresh writes it)."""
        self.entry = replace(self.entry, role=role, draining=False)
        await self._write()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        name = self.entry.name

        async def remove(r) -> None:
            pipe = r.pipeline(transaction=False)
            pipe.delete(self.keys.worker(name))
            pipe.zrem(self.keys.workers, name)
            await pipe.execute()

        await self.link.call(remove)


class RedisMembership:
    """The live workers of one model, from the registry; implements `Membership`."""

    def __init__(self, link: RedisLink, keys: Keys, poll_s: float = 0.5, grace_s: float = 5.0) -> None:
        self.link = link
        self.keys = keys
        self.poll_s = poll_s
        # When Redis comes back empty (restarted, or flushed: the whole registry gone at once), the serving
        # workers of the last view stay in it this long while they register again, so requests do not fail
        # meanwhile. Otherwise an entry that goes goes at once (its worker left, or its lease ran out).
        self.grace_s = grace_s
        self._view: dict[str, RegistryEntry] = {}
        self._vanished: dict[str, float] = {}  # name -> when its entry was first missing, in a reset
        self._reset_at = float("-inf")  # when the link last came back (Redis may have restarted empty)
        link.on_up(self._link_up)
        self._callbacks: list[Callable[[], None]] = []
        self._task: asyncio.Task | None = None

    def workers(self) -> list[WorkerInfo]:
        return [_info(e) for e in self._view.values()]

    def entries(self) -> dict[str, RegistryEntry]:
        return dict(self._view)

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    async def refresh(self) -> bool:
        """Read the registry once; False (the last view kept) when Redis did not answer."""
        async def read(r):
            live, expired = await read_leases(r, self.keys.workers)
            values = await r.mget([self.keys.worker(n) for n in live]) if live else []
            return live, values, expired

        got = await self.link.call(read)
        if got is None:
            return False
        names, values, expired = got
        view: dict[str, RegistryEntry] = {}
        for name, raw in zip(names, values, strict=True):
            if raw is None:
                REJECTED.labels("missing_entry").inc()
                continue
            try:
                entry = RegistryEntry.decode(raw)
            except WireError as e:
                REJECTED.labels("invalid").inc()
                log.warning("ignoring an invalid registry entry for %r: %s", name[:64], e)
                continue
            if entry.name != name:
                REJECTED.labels("name_mismatch").inc()
                continue
            view[name] = entry
        if expired:  # their leases ran out: whoever reads first clears them
            await self.link.call(lambda r: drop_leases(r, self.keys.workers, [self.keys.worker(n) for n in expired],
                                                       expired))
        self._keep_vanished(view, set(expired))
        changed = _key(view) != _key(self._view)
        self._view = view
        if changed:
            for cb in self._callbacks:
                cb()
        return True

    async def _link_up(self) -> None:
        self._reset_at = time.monotonic()

    def _keep_vanished(self, view: dict[str, RegistryEntry], expired: set[str]) -> None:
        now = time.monotonic()
        read = set(view)
        for name in [n for n in self._vanished if n in read or n in expired]:
            del self._vanished[name]  # back, or its lease ran out after all
        gone = [n for n, e in self._view.items() if n not in read and n not in expired and not e.draining]
        if gone and not read and not expired:  # the whole registry at once: Redis was flushed or replaced
            self._reset_at = max(self._reset_at, now)
        for name in gone:
            since = self._vanished.setdefault(name, now)
            if now - self._reset_at < self.grace_s and now - since < self.grace_s:
                view[name] = self._view[name]
            else:
                del self._vanished[name]

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="registry-poll")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _key(view: dict[str, RegistryEntry]) -> set[tuple]:
    return {(e.name, e.instance_id, e.endpoint, e.role, e.draining) for e in view.values()}


def _info(e: RegistryEntry) -> WorkerInfo:
    return WorkerInfo(e.name, e.endpoint, e.role, e.model, e.instance_id, e.block_size, e.kv_capacity_blocks,
                      e.metrics_url, e.draining, e.num_waiting, e.num_running, e.kv_blocks_used,
                      e.waiting_prefill_tokens)


async def read_leases(r, lease_set: str) -> tuple[list[str], list[str]]:
    """Members of a lease set whose lease is still running, and those whose lease ran out (server clock)."""
    now, flat = await r.eval(READ_LEASES_SCRIPT, 1, lease_set)
    live, expired = [], []
    for member, score in zip(flat[::2], flat[1::2], strict=True):
        name = member.decode() if isinstance(member, bytes) else member
        (live if float(score) > int(now) else expired).append(name)
    return sorted(live), expired


async def drop_leases(r, lease_set: str, records: list[str], members: list[str]) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.delete(*records)
    pipe.zrem(lease_set, *members)
    await pipe.execute()
