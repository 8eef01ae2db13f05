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

POLL_S = 0.01  # s between two looks at the engine's published block counts (a dict read, no engine call)
# s at most between two reservations while the counts show too few free blocks (each reservation is a command
# between the engine's steps, which reads the step in flight first; the prefix cache may hold part of the prompt)
RETRY_S = 0.5


class NoRoom(Exception):  # noqa: N818 (not a failure: the gateway tries elsewhere)
    """No KV room for the prompt within the wait: the request goes back to the gateway as busy."""


async def reserve_when_room(reserve: Callable[[], Awaitable[Reservation]], free_blocks: Callable[[], int],
                            need_blocks: int, wait_s: float) -> Reservation:
    """`reserve()` again once the engine's published counts show `need_blocks` free (or every RETRY_S) until it is
    not refused for want of blocks; raises `NoRoom` once `wait_s` seconds have passed. The caller's first
    reservation was refused."""
    deadline = time.monotonic() + wait_s
    while True:
        now = time.monotonic()
        if now >= deadline:
            RESERVE_WAITS.labels("busy").inc()
            raise NoRoom(f"no KV room for the prompt within {wait_s:g} s (decode.reserveWaitSeconds)")
        next_try = min(deadline, now + RETRY_S)
        while time.monotonic() < next_try and free_blocks() < need_blocks:
            await asyncio.sleep(POLL_S)
        reservation = await reserve()
        if reservation.ticket is not None or reservation.refused != "no_free_blocks":
            RESERVE_WAITS.labels("reserved").inc()
            return reservation
        await asyncio.sleep(POLL_S)  # the counts lag the engine by a step: let them catch up before the next look
