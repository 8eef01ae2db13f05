"""A decode worker waiting for KV room (`decode_worker.room`), on a hand-made engine: a reservation refused for want
of blocks is tried again as blocks free, and given up (busy) at the deadline; no clocks are asserted on."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.decode_worker.metrics import RESERVE_WAITS
from splitserve.decode_worker.room import NoRoom, reserve_when_room
from splitserve.engine.interface import Reservation


class Engine:
    """Blocks in use, and a reservation that fits when `need` blocks are free of `total`."""

    def __init__(self, used: int, total: int, need: int) -> None:
        self.used, self.total, self.need = used, total, need
        self.tries = 0

    def free(self) -> int:
        return self.total - self.used

    async def reserve(self) -> Reservation:
        self.tries += 1
        if self.total - self.used >= self.need:
            return Reservation(b"ticket")
        return Reservation(None, 0, "no_free_blocks")


def count(outcome: str) -> float:
    return RESERVE_WAITS.labels(outcome)._value.get()


def test_a_reservation_waits_for_blocks_to_free_then_takes_them():
    engine = Engine(used=90, total=100, need=30)
    before = count("reserved")

    async def main() -> Reservation:
        waiting = asyncio.ensure_future(reserve_when_room(engine.reserve, engine.free, 30, wait_s=60))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # still no room
        tries = engine.tries
        engine.used = 60  # requests finished: their blocks are free
        return await asyncio.wait_for(waiting, 30), tries

    reservation, tries_while_full = asyncio.run(main())
    assert reservation.ticket == b"ticket" and count("reserved") == before + 1
    # while the published counts showed no room it tried at most every RETRY_S, not at every look
    assert tries_while_full <= 2


def test_no_room_within_the_wait_is_busy():
    engine = Engine(used=99, total=100, need=30)
    before = count("busy")
    with pytest.raises(NoRoom, match="reserveWaitSeconds"):
        asyncio.run(reserve_when_room(engine.reserve, engine.free, 30, wait_s=0.2))
    assert count("busy") == before + 1


def test_a_refusal_for_another_reason_ends_the_wait():
    async def short() -> Reservation:
        return Reservation(None, 512, "short_prompt")  # mostly cached here: prefilled locally, not waited for

    r = asyncio.run(reserve_when_room(short, lambda: 100, 30, wait_s=60))
    assert r.refused == "short_prompt"
