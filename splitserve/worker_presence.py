"""A worker's part in the Redis-backed cluster (`ClusterPresence`): its registry entry (a lease, with its load and
its role, rewritten when it flips), its KV block events, and the registry as the membership its role uses.
Redis-free: a static membership and nothing else."""

from __future__ import annotations

import logging
import uuid

from splitserve.common.config import ClusterSpec
from splitserve.common.kv_events import KVEventPublisher
from splitserve.common.membership import Membership, StaticMembership
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import Keys, RegistryEntry
from splitserve.common.registry import RedisMembership, Registration
from splitserve.engine.interface import ServingEngine

log = logging.getLogger("splitserve.worker")


class ClusterPresence:
    """A worker's part in the Redis-backed cluster: its registry entry (a lease, with its load), its KV block
    events, and the registry as the membership its role uses. Redis-free: a static membership and nothing else."""

    def __init__(self, spec: ClusterSpec, role: str, name: str, endpoint: str, metrics_url: str) -> None:
        self.spec, self.role, self.name = spec, role, name
        self.endpoint, self.metrics_url = endpoint, metrics_url
        self.instance_id = uuid.uuid4().hex[:16]
        url = spec.redis.resolved_url()
        self.link = RedisLink(url) if url else None
        self.keys = Keys(spec.model.served_name)
        self.registration: Registration | None = None
        self.publisher: KVEventPublisher | None = None
        if self.link is not None:
            self.membership: Membership = RedisMembership(self.link, self.keys)
        else:
            self.membership = StaticMembership(spec.membership.prefill, spec.membership.decode,
                                               spec.worker_role("decode"))

    async def start(self) -> None:
        if self.link is not None:
            await self.link.start()
        await self.membership.start()

    async def join(self, engine: ServingEngine) -> None:
        """Publish this worker: its KV events from now on, then its registry entry (it takes requests)."""
        if self.link is None:
            return
        self.publisher = KVEventPublisher(self.link.client, self.keys, self.name, self.instance_id)
        engine.add_kv_event_listener(self.publisher.listener)
        self.publisher.start()

        def load() -> dict:
            s = engine.stats()
            return {"num_waiting": s["num_waiting"], "num_running": s["num_running"],
                    "kv_blocks_used": s["kv_blocks_used"], "waiting_prefill_tokens": s["waiting_prefill_tokens"]}

        entry = RegistryEntry(self.name, self.instance_id, self.role, self.spec.model.served_name, self.endpoint,
                              self.metrics_url, engine.facts.block_size, engine.facts.num_kv_blocks)
        self.registration = Registration(self.link, self.keys, entry, self.spec.redis.lease_seconds, load=load)
        self.registration.on_lost = self._republish
        await self.registration.start()
        self.link.on_up(self._rejoin)
        log.info("registered as %s (instance %s) at %s", self.name, self.instance_id, self.endpoint)

    async def _rejoin(self) -> None:
        """Redis is back (perhaps empty, perhaps another one): register again and republish the whole cache."""
        self.publisher.resync()
        await self.registration.refresh()

    async def _republish(self) -> None:
        self.publisher.resync()

    async def drain(self) -> None:
        if self.registration is not None:
            await self.registration.drain()

    async def leave_role(self) -> None:
        """A flip begins: the entry says draining (gateways and peers send this worker nothing new)."""
        await self.drain()

    async def serve_as(self, role: str) -> None:
        """A flip is done: the entry names `role` and takes requests again."""
        self.role = role
        if self.registration is not None:
            await self.registration.serve_as(role)

    async def close(self) -> None:
        if self.registration is not None:
            await self.registration.close()
        if self.publisher is not None:
            await self.publisher.flush()
            await self.publisher.close()
        await self.membership.close()
        if self.link is not None:
            await self.link.close()
