"""Waiting for KV room on a decode worker: a remote prefill's reservation that found no free blocks is tried again
as the engine frees blocks, until a deadline (`decode.reserveWaitSeconds`); then the request goes back to the
gateway as busy, which tries another decode worker or this one after a pause. A long prompt is never prefilled
here for want of blocks: its chunks would slow every stream decoding here, which would hold their blocks longer,
which would fail the next reservation too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from splitserve.decode_worker.metrics import RESERVE_WAITS
from splitserve.engine.interface import Reservation

POLL_S = 0.01  # s between two looks at the engine's published block count (a dict read, no engine call)
RETRY_S = 0.1  # s at most between two reservations while no block frees (each is a command between steps)


class NoRoom(Exception):  # noqa: N818 (not a failure: the gateway tries elsewhere)
    """No KV room for the prompt within the wait: the request goes back to the gateway as busy."""


async def reserve_when_room(reserve: Callable[[], Awaitable[Reservation]], used_blocks: Callable[[], int],
                            wait_s: float) -> Reservation:
    """`reserve()` again whenever the engine's used blocks drop (or every RETRY_S) until it is not refused for want of
    blocks; raises `NoRoom` once `wait_s` seconds have passed. The caller's first reservation was refused."""
    deadline = time.monotonic() + wait_s
    while True:
        now = time.monotonic()
        if now >= deadline:
            RESERVE_WAITS.labels("busy").inc()
            raise NoRoom(f"no KV room for the prompt within {wait_s:g} s (decode.reserveWaitSeconds)")
        used = used_blocks()
        next_try = min(deadline, now + RETRY_S)
        while time.monotonic() < next_try and used_blocks() >= used:
            await asyncio.sleep(POLL_S)
        reservation = await reserve()
        if reservation.ticket is not None or reservation.refused != "no_free_blocks":
            RESERVE_WAITS.labels("reserved").inc()
            return reservation
