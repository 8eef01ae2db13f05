"""A worker whose drain runs out of time ends each stream it still runs with a `drain` retry, so that the
gateway moves it: whether the stream was waiting on the engine or the server was still sending its last chunk
(a slow write on a loaded host: a cancel there used to end the call with no reason, and the gateway counted the
move as the worker gone). The role's service is a hand-made stand-in (no engine is needed to order these
events); the server's slow write is the consumer's own sleep between chunks."""

from __future__ import annotations

import asyncio

from splitserve.common.config import ClusterSpec
from splitserve.common.sampling import SamplingParams
from splitserve.common.worker_messages import GenerateCall, GenerateChunk, RetryReason
from splitserve.worker import Worker


class Service:
    """Streams one token every `every` s, forever; records whether the engine let the request go."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.released: list[str] = []

    async def generate(self, call: GenerateCall):
        try:
            for i in range(10_000):
                await asyncio.sleep(self.every)
                yield GenerateChunk(call.request_id, [i])
        finally:
            self.released.append(call.request_id)


def drained(engine_every: float, write_s: float) -> tuple[list[GenerateChunk], Service, Worker]:
    """One stream: the drain ends after its third chunk arrives at the server, which takes `write_s` to send
    each chunk while the service waits `engine_every` for each token."""
    worker = Worker(ClusterSpec(), "decode")
    service = Service(engine_every)
    worker.service = service
    got: list[GenerateChunk] = []

    async def main() -> None:
        call = GenerateCall("r", [1, 2, 3], SamplingParams(max_tokens=100_000))
        third = asyncio.Event()

        async def server() -> None:
            async for chunk in worker.generate(call):
                got.append(chunk)
                if len(got) == 3:
                    third.set()
                await asyncio.sleep(write_s)  # sending it

        sending = asyncio.create_task(server())
        await third.wait()
        await asyncio.sleep(0.01)
        assert worker.move_streams() == 1
        await asyncio.wait_for(sending, 5)
        assert worker.outstanding == 0

    asyncio.run(main())
    return got, service, worker


def test_a_stream_waiting_on_the_engine_ends_with_a_drain_retry():
    got, service, _ = drained(engine_every=0.5, write_s=0.0)
    assert [c.token_ids for c in got[:3]] == [[0], [1], [2]]
    assert got[-1].finished and got[-1].retry == RetryReason.DRAIN and len(got) == 4
    assert service.released == ["r"]


def test_a_stream_whose_chunk_is_still_being_sent_ends_with_a_drain_retry_too():
    got, service, _ = drained(engine_every=0.0, write_s=0.5)
    assert [c.token_ids for c in got[:3]] == [[0], [1], [2]]
    assert got[-1].finished and got[-1].retry == RetryReason.DRAIN and len(got) == 4
    assert service.released == ["r"]  # the engine let the request go
