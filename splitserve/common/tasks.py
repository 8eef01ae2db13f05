"""Background tasks with an owner: every task's outcome is observed (an error is logged, never left
"never retrieved"), and closing the owner cancels and awaits what is left."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("splitserve.tasks")


def settle(future: asyncio.Future | None) -> None:
    """Let go of a task or future whose outcome no longer matters: cancel it if it is still running, or observe
    its error if it already failed (the caller reports what matters; nothing is left "never retrieved")."""
    if future is None:
        return
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


class TaskOwner:
    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}: {what}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.warning("%s failed: %s: %s", task.get_name(), type(error).__name__, error)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float) -> int:
        """Until every task has ended, or `timeout` seconds; how many are still running."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        return len(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
