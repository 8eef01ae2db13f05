"""`GrpcWorkerClient` against an in-process gRPC worker service: each call's messages come back as the
client's dataclasses, and each way a call fails is one `WorkerCallError` kind."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.common.proc import free_port
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.common.worker_client import GrpcWorkerClient
from splitserve.common.worker_messages import (
    GenerateCall,
    HealthReport,
    LoadReport,
    PrefillCall,
    WorkerCallError,
)


class Worker(pb_grpc.WorkerServicer):
    async def Generate(self, request, context):
        if request.request_id == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: empty")
        lp = pb.TokenLogprob(token_id=5, logprob=-0.5, top=[pb.TopLogprob(token_id=5, logprob=-0.5)])
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[5], logprobs=[lp], prompt_tokens=3,
                                  completion_tokens=1)
        if request.request_id == "dies":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine gone")
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[6], finished=True, finish_reason="length",
                                  prompt_tokens=3, completion_tokens=2, remote_prefill=True)

    async def Prefill(self, request, context):
        if request.ticket != b"t":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kv transfer failed")
        await asyncio.sleep(float(request.params.max_tokens) / 1000)
        return pb.PrefillResponse(request_id=request.request_id, first_token_id=9, cached_tokens=16, kv_bytes=1024)

    async def Abort(self, request, context):
        return pb.AbortResponse(found=request.request_id == "known")

    async def Health(self, request, context):
        return pb.HealthResponse(live=True, ready=True, role="decode", model="m", protocol_version=PROTOCOL_VERSION)

    async def Stats(self, request, context):
        return pb.StatsResponse(num_waiting=1, num_running=2, kv_blocks_used=3, kv_blocks_total=4, tokens_in_flight=5,
                                num_waiting_remote_kv=6, num_held=7, outstanding_requests=8)


class EarlyWorker(Worker):
    """Serves PrefillEarly: records what came and when (the request, then the ticket)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.ended = asyncio.Event()

    async def PrefillEarly(self, request_iterator, context):
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("body")
                self.seen.append(kind if kind == "request" else f"ticket:{msg.ticket.decode()}")
            return pb.PrefillResponse(request_id="r", first_token_id=7, cached_tokens=len(self.seen))
        finally:
            self.ended.set()


async def with_client(fn, worker=None):
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(worker or Worker(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    client = GrpcWorkerClient(f"127.0.0.1:{port}")
    try:
        return await fn(client)
    finally:
        await client.close()
        await server.stop(None)


def test_each_call_answers_in_dataclasses():
    async def calls(client):
        stream = client.generate(GenerateCall("r", [1, 2, 3], SamplingParams(max_tokens=2)))
        chunks = [c async for c in stream]
        stream.cancel()  # after the end: harmless
        reply = await client.prefill(PrefillCall("r", [1, 2, 3], SamplingParams(max_tokens=1), b"t"), timeout_s=5)
        return (chunks, reply, await client.abort("known"), await client.abort("other"), await client.health(2),
                await client.load(2))

    chunks, reply, known, other, health, load = asyncio.run(with_client(calls))
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert chunks[0].logprobs == [Logprob(5, -0.5, [(5, -0.5)])] and not chunks[0].finished
    assert chunks[1].finished and chunks[1].finish_reason == "length" and chunks[1].remote_prefill
    assert (reply.first_token_id, reply.first_logprob, reply.cached_tokens, reply.kv_bytes) == (9, None, 16, 1024)
    assert known and not other
    assert health == HealthReport(True, True, "decode", False, "m", PROTOCOL_VERSION)
    assert load == LoadReport(1, 2, 3, 4, 5, 6, 7, 8)


@pytest.mark.parametrize("rid,kind,chunks", [("bad", "invalid", 0), ("dies", "unavailable", 1)])
def test_a_failed_generate_is_one_error_kind(rid, kind, chunks):
    async def call(client):
        got = []
        with pytest.raises(WorkerCallError) as e:
            async for c in client.generate(GenerateCall(rid, [1], SamplingParams())):
                got.append(c)
        return e.value, got

    error, got = asyncio.run(with_client(call))
    assert error.kind == kind and len(got) == chunks


def test_prefill_failures_and_deadlines_and_a_worker_that_is_not_there():
    async def calls(client):
        errors = []
        for ticket, ms, timeout in ((b"x", 1, 5.0), (b"t", 2000, 0.2)):
            with pytest.raises(WorkerCallError) as e:
                await client.prefill(PrefillCall("r", [1], SamplingParams(max_tokens=ms), ticket), timeout_s=timeout)
            errors.append(e.value.kind)
        return errors

    assert asyncio.run(with_client(calls)) == ["unavailable", "timeout"]

    async def nobody():
        client = GrpcWorkerClient(f"127.0.0.1:{free_port()}")
        try:
            with pytest.raises(WorkerCallError) as e:
                await client.health(2)
            return e.value.kind
        finally:
            await client.close()

    assert asyncio.run(nobody()) == "unavailable"


def test_an_early_prefill_sends_the_request_before_its_ticket_and_can_be_given_up_before_it():
    worker = EarlyWorker()

    async def calls(client):
        loop = asyncio.get_running_loop()
        ticket = loop.create_future()
        call = asyncio.ensure_future(client.prefill(PrefillCall("r", [1, 2], SamplingParams(max_tokens=1), b""),
                                                    timeout_s=5, ticket=ticket))
        for _ in range(200):  # the request reaches the worker while the ticket is still being made
            if worker.seen:
                break
            await asyncio.sleep(0.01)
        seen_before_ticket = list(worker.seen)
        ticket.set_result(b"t")
        reply = await call
        worker.seen.clear()
        worker.ended.clear()
        never = loop.create_future()  # a reservation that was refused: the call is given up before its ticket
        given_up = asyncio.ensure_future(client.prefill(PrefillCall("r", [1], SamplingParams(max_tokens=1), b""),
                                                        timeout_s=5, ticket=never))
        await asyncio.sleep(0.2)
        given_up.cancel()
        await asyncio.wait_for(worker.ended.wait(), 5)  # the worker's call ended: it stops computing
        return seen_before_ticket, reply, list(worker.seen)

    before, reply, abandoned = asyncio.run(with_client(calls, worker))
    assert before == ["request"]
    assert (reply.first_token_id, reply.cached_tokens) == (7, 2)  # both messages, in order
    assert abandoned == ["request"]


def test_an_early_prefill_to_a_worker_without_it_sends_the_ticket_with_the_request():
    async def calls(client):
        ticket = asyncio.get_running_loop().create_future()
        ticket.set_result(b"t")
        first = await client.prefill(PrefillCall("r", [1], SamplingParams(max_tokens=1), b""), timeout_s=5,
                                     ticket=ticket)
        second = await client.prefill(PrefillCall("r", [1], SamplingParams(max_tokens=1), b""), timeout_s=5,
                                      ticket=ticket)
        return first, second, client._early

    first, second, early = asyncio.run(with_client(calls))  # `Worker` answers PrefillEarly UNIMPLEMENTED
    assert first.first_token_id == second.first_token_id == 9
    assert not early  # asked once; the next call went the old way at once
