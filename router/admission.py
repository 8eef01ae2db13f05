"""Bounded admission: at most `max_inflight` requests run at once; up to `max_queue` more wait in arrival order
(for at most `timeout` seconds, or until a worker can take them); beyond that a request gets 429 with
Retry-After. A slow cluster queues requests instead of failing them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from splitserve.router import metrics as m
from splitserve.router.errors import APIError


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, timeout: float) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.timeout = timeout
        self.inflight = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _publish(self) -> None:
        m.QUEUE_DEPTH.set(self.inflight + len(self._waiters))
        m.INFLIGHT.set(self.inflight)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: longer the deeper the queue."""
        return max(1, min(60, 1 + len(self._waiters) // max(1, self.max_inflight)))

    async def acquire(self) -> None:
        if self.inflight < self.max_inflight and not self._waiters:
            self.inflight += 1
            self._publish()
            return
        if len(self._waiters) >= self.max_queue:
            raise APIError(429, "too many requests queued; retry later", code="queue_full",
                           headers={"Retry-After": str(self.retry_after())})
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._publish()
        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.shield(fut)
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # handed a seat at the last moment: give it back
                self._release_seat()
            else:
                fut.cancel()
            raise APIError(429, f"waited {self.timeout:.0f} s for a free seat; retry later", code="queue_timeout",
                           headers={"Retry-After": str(self.retry_after())}) from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release_seat()
            else:
                fut.cancel()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)
            self._publish()

    def release(self) -> None:
        self._release_seat()

    def _release_seat(self) -> None:
        """A seat frees up: hand it to the oldest live waiter, or return it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the seat passes on; inflight stays the same
                self._publish()
                return
        self.inflight -= 1
        self._publish()

    @contextlib.asynccontextmanager
    async def seat(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()
