"""The worker's side of the wire (`protocol.server`) against a hand-made handler, over real gRPC on loopback:
each call's dataclasses arrive as `GrpcWorkerClient` sent them and come back as the handler returned them
(the retry reason included), a request that fails validation never reaches the handler, and each typed error a
handler raises reaches the caller as its status code."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.common.proc import free_port
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.server import GrpcWorkerServer
from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.common.worker_client import GrpcWorkerClient
from splitserve.common.worker_messages import (
    Draining,
    GenerateCall,
    GenerateChunk,
    HealthReport,
    InvalidRequest,
    LoadReport,
    NotReady,
    NotServed,
    PrefillCall,
    PrefillReply,
    RequestIdInUse,
    RetryReason,
    TransferFailed,
)

ERRORS = {"loading": NotReady("worker is loading its model"), "draining": Draining("worker is draining"),
          "prefill-only": NotServed("a prefill worker does not serve generate"),
          "clash": RequestIdInUse("request id 'clash' is already in use"),
          "bad-prompt": InvalidRequest("prompt_token_ids: ids must be below the vocabulary size 10"),
          "transfer": TransferFailed("kv transfer failed: peer gone")}
LP = Logprob(5, -0.5, [(5, -0.5), (6, -1.5)])


class Handler:
    def __init__(self) -> None:
        self.calls: list[GenerateCall | PrefillCall] = []
        self.tickets: list[bytes | str] = []  # each early prefill's ticket, or the error it raised

    async def generate(self, call: GenerateCall):
        self.calls.append(call)
        if call.request_id in ERRORS:
            raise ERRORS[call.request_id]
        yield GenerateChunk(call.request_id, [5], [LP], prompt_tokens=3, cached_tokens=2, completion_tokens=1,
                            remote_prefill=True)
        yield GenerateChunk(call.request_id, [], finished=True, finish_reason="error", error="stopping",
                            completion_tokens=1, retry=RetryReason.DRAIN)

    async def prefill(self, call: PrefillCall) -> PrefillReply:
        self.calls.append(call)
        if call.request_id in ERRORS:
            raise ERRORS[call.request_id]
        return PrefillReply(9, LP, 16, 1024, b"receipt")

    async def prefill_early(self, call: PrefillCall, ticket) -> PrefillReply:
        self.calls.append(call)
        try:
            self.tickets.append(await ticket)
        except (InvalidRequest, TransferFailed) as e:
            self.tickets.append(f"{type(e).__name__}: {e}")
            raise
        return PrefillReply(7, None, 0, 0)

    async def abort(self, request_id: str) -> bool:
        return request_id == "known"

    def health(self) -> HealthReport:
        return HealthReport(True, True, "decode", False, "m", PROTOCOL_VERSION, "vllm", frozenset({"resume"}))

    def load(self) -> LoadReport:
        return LoadReport(1, 2, 3, 4, 5, 6, 7, 8)


async def with_server(fn, handler: Handler):
    server = GrpcWorkerServer(handler)
    address = f"127.0.0.1:{free_port()}"
    await server.start(address)
    client = GrpcWorkerClient(address)
    channel = grpc.aio.insecure_channel(address)
    try:
        return await fn(client, pb_grpc.WorkerStub(channel), channel)
    finally:
        await channel.close()
        await client.close()
        await server.stop(None)


def test_each_call_arrives_and_answers_as_the_dataclasses_sent():
    handler = Handler()
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=["x"], logprobs=2, min_tokens=1,
                            output_offset=2)

    async def calls(client, stub, channel):
        chunks = [c async for c in client.generate(GenerateCall("r", [1, 2, 3], params, "p-0", 4, (8, 9)))]
        reply = await client.prefill(PrefillCall("q", [1, 2], params, b"ticket"), timeout_s=5)
        return chunks, reply, await client.health(2), await client.load(2), await client.abort("known")

    chunks, reply, health, load, found = asyncio.run(with_server(calls, handler))
    generate, prefill = handler.calls
    assert (generate.request_id, list(generate.prompt_token_ids), generate.params, generate.prefill_worker,
            generate.priority, list(generate.resume_token_ids)) == ("r", [1, 2, 3], params, "p-0", 4, [8, 9])
    assert (prefill.request_id, list(prefill.prompt_token_ids), prefill.params, prefill.ticket) == \
        ("q", [1, 2], params, b"ticket")
    assert chunks == [GenerateChunk("r", [5], [LP], prompt_tokens=3, cached_tokens=2, completion_tokens=1,
                                    remote_prefill=True),
                      GenerateChunk("r", [], finished=True, finish_reason="error", error="stopping",
                                    completion_tokens=1, retry=RetryReason.DRAIN)]
    assert reply == PrefillReply(9, LP, 16, 1024, b"receipt")
    assert health == HealthReport(True, True, "decode", False, "m", PROTOCOL_VERSION, "vllm", frozenset({"resume"}))
    assert load == LoadReport(1, 2, 3, 4, 5, 6, 7, 8) and found


@pytest.mark.parametrize("rid,code", [
    ("loading", grpc.StatusCode.UNAVAILABLE), ("draining", grpc.StatusCode.UNAVAILABLE),
    ("prefill-only", grpc.StatusCode.FAILED_PRECONDITION), ("clash", grpc.StatusCode.ALREADY_EXISTS),
    ("bad-prompt", grpc.StatusCode.INVALID_ARGUMENT), ("transfer", grpc.StatusCode.UNAVAILABLE)])
def test_a_typed_error_reaches_the_caller_as_its_status_code(rid, code):
    async def calls(client, stub, channel):
        got = []
        for rpc, msg in ((stub.Generate, pb.GenerateRequest), (stub.Prefill, pb.PrefillRequest)):
            req = msg(protocol_version=PROTOCOL_VERSION, request_id=rid, prompt_token_ids=[1],
                      params=pb.SamplingParams(max_tokens=1, top_p=1.0))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                call = rpc(req, timeout=5)
                await (call.read() if msg is pb.GenerateRequest else call)
            got.append((e.value.code(), e.value.details()))
        return got

    got = asyncio.run(with_server(calls, Handler()))
    assert got == [(code, str(ERRORS[rid]))] * 2


def test_a_request_that_fails_validation_never_reaches_the_handler():
    handler = Handler()
    good = {"protocol_version": PROTOCOL_VERSION, "request_id": "r", "prompt_token_ids": [1],
            "params": pb.SamplingParams(max_tokens=1, top_p=1.0)}

    async def calls(client, stub, channel):
        got = []
        for change in ({"protocol_version": 99}, {"request_id": ""}, {"params": pb.SamplingParams(max_tokens=1)}):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(pb.GenerateRequest(**(good | change)), timeout=5).read()
            got.append((e.value.code(), e.value.details().split(" ")[0]))
        with pytest.raises(grpc.aio.AioRpcError) as e:  # bytes that are not a GenerateRequest
            await channel.unary_stream("/splitserve.v1.Worker/Generate")(b"\xff\xff\xff", timeout=5).read()
        got.append((e.value.code(), e.value.details().split(" (")[0]))
        return got

    got = asyncio.run(with_server(calls, handler))
    assert got == [(grpc.StatusCode.INVALID_ARGUMENT, "protocol_version"),
                   (grpc.StatusCode.INVALID_ARGUMENT, "request_id:"), (grpc.StatusCode.INVALID_ARGUMENT, "params:"),
                   (grpc.StatusCode.INVALID_ARGUMENT, "Generate: malformed request")]
    assert handler.calls == []


def test_an_early_prefill_hands_its_ticket_over_when_it_comes_and_refuses_messages_out_of_order():
    handler = Handler()
    request = pb.PrefillRequest(protocol_version=PROTOCOL_VERSION, request_id="e", prompt_token_ids=[1, 2],
                                params=pb.SamplingParams(max_tokens=1, top_p=1.0))

    async def early(stub, *messages):
        async def stream():
            for m in messages:
                yield m

        try:
            return await stub.PrefillEarly(stream(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()

    async def calls(client, stub, channel):
        ticket = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(client.prefill(PrefillCall("e", [1, 2], SamplingParams(max_tokens=1), b""),
                                                    timeout_s=5, ticket=ticket))
        while not handler.calls:  # the request is with the handler before its ticket
            await asyncio.sleep(0.01)
        ticket.set_result(b"late ticket")
        reply = await call
        wrong_second = await early(stub, pb.PrefillStreamMessage(request=request),
                                   pb.PrefillStreamMessage(request=request))
        wrong_first = await early(stub, pb.PrefillStreamMessage(ticket=b"t"))
        return reply, wrong_second, wrong_first

    reply, wrong_second, wrong_first = asyncio.run(with_server(calls, handler))
    assert reply == PrefillReply(7, None, 0, 0) and handler.tickets[0] == b"late ticket"
    assert wrong_second == (grpc.StatusCode.INVALID_ARGUMENT, "PrefillEarly: the second message must be the ticket")
    assert handler.tickets[1] == "InvalidRequest: PrefillEarly: the second message must be the ticket"
    assert wrong_first == (grpc.StatusCode.INVALID_ARGUMENT, "PrefillEarly: the first message must be the request")
    assert len(handler.calls) == 2  # the request without a request never reached it
