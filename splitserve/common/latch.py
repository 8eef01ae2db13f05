"""A one-shot latch set from any thread and awaited from asyncio without tying up a worker thread (unlike
`asyncio.to_thread(event.wait)`, which holds one of a few pool threads for as long as it waits)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class Latch(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._cb_lock = threading.Lock()

    def set(self) -> None:
        with self._cb_lock:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    async def wait_async(self, timeout: float | None = None) -> bool:
        """True once set; False if `timeout` seconds pass first."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(True))

        with self._cb_lock:
            if self.is_set():
                return True
            self._callbacks.append(wake)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            return self.is_set()
