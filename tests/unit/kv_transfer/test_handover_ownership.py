"""The decode side of the KV handover owns a reservation's blocks: after a cancel (a failed or abandoned remote
prefill) they are freed only once the prefill call has ended and no write of the transfer can land any more,
and then nothing is left behind: no reserved request, no used block, no transfer record."""

from __future__ import annotations

import asyncio
import socket
import time
import zlib

from support.helpers import greedy, make_engine

from splitserve.engine.async_engine import AsyncEngine
from splitserve.kv_transfer import KVLayout, TransferTicket, make_agent
from splitserve.kv_transfer.agent import KVTransferAgent
from splitserve.kv_transfer.handover import NativeDecodeHandover
from splitserve.kv_transfer.tcp_backend import HEADER, KIND_DATA, MAGIC, RUN


def held(engine: AsyncEngine) -> tuple[int, int]:
    """(requests waiting for remote KV, KV blocks in use) as the engine's counters say."""
    s = engine.stats()
    return s["num_waiting_remote_kv"], s["kv_blocks_used"]


async def settles(engine: AsyncEngine, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while held(engine) != (0, 0):
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True


def test_a_cancelled_reservation_is_freed_after_the_call_and_the_last_write(smollm2_dir):
    """TCP: a sender is half-way through a frame into the reserved blocks when the decode side gives up. The
    blocks stay reserved while the prefill call runs, and after it ended while the frame is still being
    written; once the frame ends they are freed, and neither the engine nor the agent keeps anything."""
    engine = AsyncEngine(make_engine(smollm2_dir))
    agent = make_agent("tcp", KVLayout(engine.kv_tensors(), engine.kv_shard))
    handover = NativeDecodeHandover(engine, agent)
    prompt = list(range(1000, 1100))  # 100 tokens: 7 blocks of 16

    async def main() -> None:
        res = await handover.reserve("r", prompt, greedy(4), min_remote_tokens=32, timeout_s=30)
        assert res.ticket is not None and res.num_cached_tokens == 0 and not res.refused
        ticket = TransferTicket.decode(res.ticket)
        assert held(engine) == (1, len(ticket.block_ids))
        layout = agent.layout
        bb = layout.block_size * layout.num_heads * layout.head_bytes  # bytes of one block of one layer's K
        payload = bytes(range(256)) * (bb // 256) + bytes(bb % 256)
        host, _, port = ticket.ranks[0].endpoint.rpartition(":")
        rid = b"r"
        head = HEADER.pack(MAGIC, KIND_DATA, 1, 0, 0, len(rid), 1, 0, layout.num_heads, 0, 1, bb,
                           zlib.crc32(payload))
        sender = socket.create_connection((host, int(port)))
        sender.sendall(head + rid + RUN.pack(ticket.block_ids[0], 1) + payload[: bb // 2])  # half a frame
        for _ in range(100):  # the receiver took the frame on
            if agent._pending["r"].writing:
                break
            await asyncio.sleep(0.01)
        assert agent._pending["r"].writing == 1

        call: asyncio.Future = asyncio.get_running_loop().create_future()  # the prefill call, still running
        handover.cancel("r", call)
        await asyncio.sleep(0.3)
        assert held(engine) == (1, len(ticket.block_ids)), "freed while the prefill call was running"
        call.set_exception(ConnectionError("prefill worker gone"))  # the call ended (its error is the caller's)
        call.exception()
        await asyncio.sleep(0.3)
        assert held(engine) == (1, len(ticket.block_ids)), "freed while a write was landing in its blocks"
        sender.sendall(payload[bb // 2 :])  # the frame ends: nothing more of this transfer can be written
        assert await settles(engine), held(engine)
        assert agent.num_pending == 0 and not agent._unquiet
        sender.close()

    try:
        asyncio.run(main())
    finally:
        asyncio.run(handover.close())
        engine.shutdown()


def test_a_late_frame_after_the_cancel_is_refused_and_frees_at_once(smollm2_dir):
    """Once cancelled, a transfer takes no new frame: with none under way, the blocks go as soon as the call
    ended, and a frame that arrives later is refused (it never writes into freed, perhaps reused, blocks)."""
    engine = AsyncEngine(make_engine(smollm2_dir))
    agent = make_agent("tcp", KVLayout(engine.kv_tensors(), engine.kv_shard))
    handover = NativeDecodeHandover(engine, agent)

    async def main() -> None:
        res = await handover.reserve("late", list(range(2000, 2064)), greedy(4), timeout_s=30)
        ticket = TransferTicket.decode(res.ticket)
        call: asyncio.Future = asyncio.get_running_loop().create_future()
        call.set_result(None)
        handover.cancel("late", call)
        assert await settles(engine), held(engine)
        assert agent.begin_write("late") is None  # what the TCP receiver asks before writing a frame
        assert not agent._unquiet and agent.num_pending == 0
        assert ticket.request_id == "late"

    try:
        asyncio.run(main())
    finally:
        asyncio.run(handover.close())
        engine.shutdown()


class OneSided:
    """A backend whose senders write our memory themselves (as NIXL's do): we see only their notices."""

    name = "nixl"
    one_sided = True

    def start(self, agent) -> None:
        pass

    def endpoint_fields(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def test_one_sided_transfers_are_quiet_once_every_sender_stopped_or_at_the_deadline():
    layout = KVLayout([(make_block_tensor(), make_block_tensor())])
    agent = KVTransferAgent(layout, OneSided())

    async def main() -> None:
        agent.expect_local("a", [1, 2], 0, time.time() + 30)
        agent.cancel("a")
        agent.forget("a")
        quiet = asyncio.ensure_future(agent.quiet("a"))
        await asyncio.sleep(0.2)
        assert not quiet.done()  # its sender may still be writing
        agent.sender_stopped("a")  # its abort notice
        await asyncio.wait_for(quiet, 2)

        t0 = time.monotonic()
        agent.expect_local("b", [3], 0, time.time() + 0.5)
        agent.cancel("b")
        await agent.quiet("b")  # no word from the sender: it posts nothing after the deadline
        assert 0.3 < time.monotonic() - t0 < 3
        assert not agent._unquiet

        agent.expect_local("c", [4], 0, time.time() + 30)
        agent.landed("c", -1, (0, 1), True, 0)  # every layer landed: quiet at once
        await asyncio.wait_for(agent.quiet("c"), 1)

    try:
        asyncio.run(main())
    finally:
        agent.close()


def make_block_tensor():
    import torch

    return torch.zeros(8, 16, 2, 4)  # [num_blocks, block_size, num_kv_heads, head_dim]
