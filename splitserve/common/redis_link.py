"""A component's link to Redis (one server or a Redis Cluster, detected from the server itself), with degraded
mode built in: every call has a short deadline, a failure marks the link down, and a background task
reconnects. Callers ask `client()` (None while down) and carry on without Redis; `on_up` callbacks run when it
comes back, so state that lives in Redis can be rebuilt. Only a failure to reach Redis degrades: a call that
Redis answers with an error (a wrong command, a wrong type) is a bug and raises.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import Gauge

log = logging.getLogger("splitserve.redis")
REDIS_UP = Gauge("splitserve_redis_up", "1 while this process reaches Redis")


def unreachable_errors() -> tuple[type[BaseException], ...]:
    """What a call raises when Redis cannot be reached or cannot serve now: connection refused or lost, a
    timeout (ours or the client's), a server still loading, a cluster without a master for the key's slot."""
    from redis import exceptions as rx

    return (rx.ConnectionError, rx.TimeoutError, TimeoutError, OSError, rx.ClusterDownError, rx.TryAgainError,
            rx.SlotNotCoveredError)


async def connect(url: str, timeout: float = 1.0):
    """A redis.asyncio client for `url`: a cluster client when the server runs in cluster mode."""
    import redis.asyncio as aioredis

    plain = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        info = await plain.info("cluster")
    except Exception:
        await plain.aclose()
        raise
    if not info.get("cluster_enabled"):
        return plain
    await plain.aclose()
    cluster = aioredis.RedisCluster.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    await cluster.initialize()
    return cluster


class RedisLink:
    """`timeout` bounds each socket read and connect (a call gets twice it); `name` and `up_gauge` tell this
    link apart from another the process keeps (the KV pool's bulk reads have a link of their own, with the
    pool's read deadline, so a slow read of megabytes neither trips nor waits behind the registry's lease)."""

    def __init__(self, url: str, timeout: float = 1.0, retry_s: float = 1.0, name: str = "redis",
                 up_gauge: Gauge = REDIS_UP) -> None:
        self.url = url
        self.timeout = timeout
        self.retry_s = retry_s
        self.name = name
        self._gauge = up_gauge
        self._client = None
        self._task: asyncio.Task | None = None
        self._on_up: list[Callable[[], Awaitable[None]]] = []
        self.up = False
        self.failures = 0
        up_gauge.set(0)

    def client(self):
        return self._client if self.up else None

    def on_up(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run `callback` every time the link (re)connects."""
        self._on_up.append(callback)

    def failed(self, error: BaseException) -> None:
        """A call failed: the link is down until the background task reconnects."""
        if self.up:
            log.warning("%s at %s unreachable (%s: %s): going on without it", self.name, self.url,
                        type(error).__name__, error)
        self.up = False
        self.failures += 1
        self._gauge.set(0)

    async def start(self) -> None:
        await self._try_connect()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="redis-link")

    async def _try_connect(self) -> bool:
        if not self.up:
            # a reconnect starts a new client: the old one's pool may still hold connections to a server that
            # went away, and the first call on one of them would take the link straight down again
            await self._drop_client()
        try:
            if self._client is None:
                async with asyncio.timeout(3 * self.timeout):
                    self._client = await connect(self.url, self.timeout)
            async with asyncio.timeout(2 * self.timeout):
                await self._client.ping()
        except Exception as e:  # noqa: BLE001 - unreachable, refused, timed out, loading: try later
            await self._drop_client()
            if self.up:
                self.failed(e)
            return False
        if not self.up:
            self.up = True
            self._gauge.set(1)
            log.info("%s at %s reachable", self.name, self.url)
            for cb in self._on_up:
                try:
                    await cb()
                except Exception as e:  # noqa: BLE001 - a rebuild that failed retries at the next reconnect
                    self.failed(e)
                    return False
        return True

    async def _drop_client(self) -> None:
        if self._client is None:
            return
        client, self._client = self._client, None
        try:
            await client.aclose()
        except Exception:  # noqa: BLE001 - closing a client whose server is gone
            pass

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.retry_s if not self.up else 2.0)
            await self._try_connect()

    async def call(self, fn: Callable, default=None):
        """`await fn(client)` with the link's deadline. If Redis cannot be reached the link goes down and
        `default` is returned (callers go on without Redis); any other error raises."""
        client = self.client()
        if client is None:
            return default
        try:
            async with asyncio.timeout(2 * self.timeout):
                return await fn(client)
        except unreachable_errors() as e:
            self.failed(e)
            return default

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._drop_client()
        self.up = False
        self._gauge.set(0)
