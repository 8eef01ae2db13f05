"""The gateway's bounded admission on its own: seats, an ordered queue, 429 with Retry-After when full or after
waiting too long, and no seat lost whichever way a waiter leaves."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.router.admission import Admission
from splitserve.router.errors import APIError


def test_seats_queue_in_order_and_refuse_when_full():
    async def main():
        adm = Admission(max_inflight=2, max_queue=2, timeout=10)
        await adm.acquire()
        await adm.acquire()
        order = []

        async def waiter(i):
            await adm.acquire()
            order.append(i)

        w1 = asyncio.ensure_future(waiter(1))
        await asyncio.sleep(0)
        w2 = asyncio.ensure_future(waiter(2))
        await asyncio.sleep(0)
        assert adm.queued == 2
        with pytest.raises(APIError) as full:
            await adm.acquire()
        assert full.value.status == 429 and int(full.value.headers["Retry-After"]) >= 1
        adm.release()
        await w1
        adm.release()
        await w2
        assert order == [1, 2] and adm.inflight == 2 and adm.queued == 0
        adm.release()
        adm.release()
        assert adm.inflight == 0

    asyncio.run(main())


def test_a_waiter_that_times_out_or_is_cancelled_loses_no_seat():
    async def main():
        adm = Admission(max_inflight=1, max_queue=4, timeout=0.05)
        await adm.acquire()
        with pytest.raises(APIError) as late:
            await adm.acquire()
        assert late.value.status == 429 and late.value.code == "queue_timeout"
        adm.timeout = 10
        task = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        adm.release()  # nobody live is waiting: the seat comes back
        assert adm.inflight == 0 and adm.queued == 0
        async with adm.seat():
            assert adm.inflight == 1
        assert adm.inflight == 0

    asyncio.run(main())
