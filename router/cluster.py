"""What a gateway learns from Redis: the live workers (registry), the global KV index (snapshot + event stream),
and the other gateways' in-flight load. Every gateway replica keeps all of it, so replicas are equal and none
leads.

- The index is rebuilt from the latest snapshot plus the stream after it whenever Redis (re)connects, then
  follows the stream. A replica that falls behind the stream's trimmed start rebuilds.
- Any replica may write the next snapshot: a short lock (SET NX PX) picks one per interval. After a snapshot the
  stream is trimmed, keeping a margin of history for replicas that lag a little.
- Each replica publishes, per worker, the requests it has in flight and their blocks (waiting for prefill,
  decoding), under a short TTL; every replica adds the others' figures to its own.
- When Redis is unreachable the last membership is kept, the index is marked stale (the kv_aware policy then
  routes by load only), and nothing fails because of Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import (
    LEASE_SCRIPT,
    Keys,
    KVEventRecord,
    WireError,
    decode_load,
    decode_snapshot,
    encode_load,
    encode_snapshot,
    pool_hash_of_key,
)
from splitserve.common.registry import RedisMembership, drop_leases, read_leases
from splitserve.router.kv_index import KVIndex

log = logging.getLogger("splitserve.router.cluster")

EVENTS = Counter("splitserve_router_index_events", "KV events read from the stream, by outcome", ["outcome"])
INDEX_BLOCKS = Gauge("splitserve_router_index_blocks", "Distinct KV blocks in this gateway's index")
INDEX_BYTES = Gauge("splitserve_router_index_memory_bytes", "Estimated memory of this gateway's KV index")
INDEX_FRESH = Gauge("splitserve_router_index_fresh", "1 while the KV index follows the event stream (Redis up)")
DEGRADED = Gauge("splitserve_router_degraded", "1 while Redis is unreachable and routing is by load only")
REBUILDS = Counter("splitserve_router_index_rebuilds", "Times the index was rebuilt from snapshot + stream")


class ClusterState:
    def __init__(self, link: RedisLink, model: str, router_id: str | None = None, snapshot_s: float = 30.0,
                 history_s: float = 120.0, load_s: float = 0.1, lease_s: float = 5.0) -> None:
        self.link = link
        self.keys = Keys(model)
        self.router_id = router_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.membership = RedisMembership(link, self.keys, grace_s=lease_s)
        self.index = KVIndex()
        self.last_id = "0-0"
        self.fresh = False
        self.snapshot_s = snapshot_s
        self.history_ms = int(history_s * 1000)
        self.load_s = load_s
        # the gateway's own in-flight work per worker (requests, blocks waiting for prefill, blocks decoding),
        # and where the other gateways' figures, summed, go
        self.local_load_fn: Callable[[], dict[str, tuple[int, int, int]]] = dict
        self.on_peer_load: Callable[[dict[str, tuple[int, int, int]]], None] = lambda peers: None
        self.peer_load: dict[str, tuple[int, int, int]] = {}
        self._tasks: list[asyncio.Task] = []
        self._rebuilding = asyncio.Lock()
        link.on_up(self.rebuild)
        self.membership.subscribe(self._members_changed)
        DEGRADED.set(1)

    # -- what policies read -------------------------------------------------------------------------------
    def instances(self) -> dict[str, str]:
        """Live workers: name -> instance id."""
        return {name: e.instance_id for name, e in self.membership.entries().items()}

    @property
    def usable(self) -> bool:
        """Whether the index can be trusted for routing (Redis up and the stream followed)."""
        return self.fresh and self.link.up

    # -- life cycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.link.start()
        await self.membership.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(), name="kv-index"),
                       loop.create_task(self._snapshots(), name="kv-snapshots"),
                       loop.create_task(self._share_load(), name="gateway-load"),
                       loop.create_task(self._pool_evictions(), name="kv-pool-evictions")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.call(lambda r: drop_leases(r, self.keys.routers, [self.keys.router(self.router_id)],
                                                   [self.router_id]))
        await self.membership.close()
        await self.link.close()

    def _members_changed(self) -> None:
        if self.link.up:
            self.index.retain(self.instances())
            self._publish_gauges()

    def _publish_gauges(self) -> None:
        INDEX_BLOCKS.set(self.index.num_blocks)
        INDEX_BYTES.set(self.index.memory_bytes())
        INDEX_FRESH.set(int(self.usable))
        DEGRADED.set(int(not self.usable))

    # -- the index --------------------------------------------------------------------------------------------
    async def rebuild(self) -> None:
        """The index from the latest snapshot plus the stream after it (on every (re)connection)."""
        async with self._rebuilding:
            self.fresh = False
            raw = await self.link.call(lambda r: r.get(self.keys.snapshot))
            index = KVIndex()
            last_id = "0-0"
            if raw is not None:
                try:
                    last_id, sections = decode_snapshot(raw)
                    index.load_sections(sections)
                except WireError as e:
                    EVENTS.labels("bad_snapshot").inc()
                    log.warning("ignoring an invalid index snapshot: %s", e)
                    index, last_id = KVIndex(), "0-0"
            self.index, self.last_id = index, last_id
            if not self.link.up:
                return
            while await self._read(block_ms=None):
                pass
            await self.membership.refresh()
            self.index.retain(self.instances())
            self.fresh = self.link.up
            REBUILDS.inc()
            self._publish_gauges()
            log.info("kv index rebuilt: %d blocks from %d workers (stream at %s)", self.index.num_blocks,
                     len(self.index.workers()), self.last_id)

    async def _read(self, block_ms: int | None) -> int:
        """Apply the next entries of the stream; returns how many were read (0 at its end or on failure)."""
        got = await self.link.call(lambda r: r.xread({self.keys.events: self.last_id}, count=5000, block=block_ms))
        if not got:
            if not self.link.up:
                self.fresh = False
            return 0
        live = self.instances()
        entries = got[0][1]
        for entry_id, fields in entries:
            self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            try:
                rec = KVEventRecord.decode(fields)
            except WireError as e:
                EVENTS.labels("rejected").inc()
                log.debug("skipping a malformed kv event %s: %s", self.last_id, e)
                continue
            EVENTS.labels("applied" if self.index.apply(rec, live) else "stale").inc()
        return len(entries)

    async def _behind(self) -> bool:
        """Whether the stream was trimmed past our position (we missed entries)."""
        if self.last_id == "0-0":
            return False
        async def stream_info(r):
            from redis.exceptions import ResponseError

            try:
                return await r.xinfo_stream(self.keys.events)
            except ResponseError as e:
                if "no such key" not in str(e).lower():
                    raise
                return "gone"  # the stream was deleted (Redis flushed) after we read from it

        info = await self.link.call(stream_info)
        if info == "gone":
            return True
        first = (info or {}).get("first-entry") if isinstance(info, dict) else None
        if not first:
            return False
        first_id = first[0].decode() if isinstance(first[0], bytes) else first[0]
        return _id_tuple(first_id) > _id_tuple(self.last_id) and _id_tuple(first_id) != (0, 0)

    async def _follow(self) -> None:
        checked = time.monotonic()
        while True:
            if not self.link.up or not self.fresh:
                self._publish_gauges()
                await asyncio.sleep(0.2)
                continue
            await self._read(block_ms=500)
            if time.monotonic() - checked > 5:
                checked = time.monotonic()
                if await self._behind():
                    log.warning("kv index fell behind the event stream's start: rebuilding")
                    await self.rebuild()
            self._publish_gauges()

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_s)
            if not self.usable:
                continue
            got = await self.link.call(lambda r: r.set(self.keys.snapshot_lock, self.router_id, nx=True,
                                                       px=int(self.snapshot_s * 500)))
            if got:
                await self.write_snapshot()

    async def write_snapshot(self) -> None:
        """Store the index as of our stream position, then trim the stream, keeping `history_s` before it."""
        last_id = self.last_id
        raw = encode_snapshot(last_id, self.index.sections())
        if await self.link.call(lambda r: r.set(self.keys.snapshot, raw), False):
            ms = _id_tuple(last_id)[0] - self.history_ms
            if ms > 0:
                await self.link.call(lambda r: r.xtrim(self.keys.events, minid=f"{ms}-0", approximate=True))

    # -- KV pool blocks that Redis evicted or expired ----------------------------------------------------------
    async def _pool_evictions(self) -> None:
        """Drop pool blocks from the index as Redis evicts or expires them (keyspace notifications, which the
        bundled Redis enables; elsewhere, and on a Redis Cluster, a stale pool entry is simply a load miss)."""
        while True:
            client = self.link.client()
            if client is None or type(client).__name__ == "RedisCluster":
                await asyncio.sleep(2.0)
                continue
            pubsub = client.pubsub()
            try:
                await pubsub.psubscribe("__keyevent@*__:evicted", "__keyevent@*__:expired")
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
                    if msg and msg.get("type") == "pmessage":
                        h = pool_hash_of_key(msg.get("data", b""))
                        if h is not None:
                            self.index.pool.discard(h)
                            EVENTS.labels("pool_evicted").inc()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - Redis went away: the link reconnects, we subscribe again
                await asyncio.sleep(1.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001
                    pass

    # -- the other gateways' load -------------------------------------------------------------------------------
    async def _share_load(self) -> None:
        ttl_ms = int(max(2.0, 8 * self.load_s) * 1000)
        while True:
            await asyncio.sleep(self.load_s)
            own = encode_load(self.router_id, {k: list(v) for k, v in self.local_load_fn().items()})

            async def exchange(r, own=own):
                await r.eval(LEASE_SCRIPT, 2, self.keys.router(self.router_id), self.keys.routers, self.router_id,
                             own, ttl_ms)
                live, expired = await read_leases(r, self.keys.routers)
                others = [o for o in live if o != self.router_id]
                values = await r.mget([self.keys.router(o) for o in others]) if others else []
                if expired:
                    await drop_leases(r, self.keys.routers, [self.keys.router(o) for o in expired], expired)
                return others, values

            got = await self.link.call(exchange)
            if got is None:
                continue  # keep the last figures while Redis is away
            total: dict[str, list[int]] = {}
            for _, raw in zip(*got, strict=True):
                if raw is None:
                    continue
                try:
                    _, load = decode_load(raw)
                except WireError:
                    EVENTS.labels("bad_load_report").inc()
                    continue
                for worker, counts in load.items():
                    acc = total.setdefault(worker, [0, 0, 0])
                    for i in range(3):
                        acc[i] += counts[i]
            self.peer_load = {k: (v[0], v[1], v[2]) for k, v in total.items()}
            self.on_peer_load(self.peer_load)


def _id_tuple(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)
