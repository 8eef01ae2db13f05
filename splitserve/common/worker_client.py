"""The caller's side of the wire: `GrpcWorkerClient`, a `WorkerClient` (`splitserve.common.worker_messages`)
that carries the worker protocol's dataclass messages over gRPC; no protobuf type leaves this module.

The gateway calls decode workers through it, and a decode worker's assembly gives its service one per prefill
peer (roles may not import each other, so it lives in the bottom layer, next to the protocol it speaks). A failed
call raises `WorkerCallError`, whose `kind` (from the call's status code) is what a caller decides on (retry
elsewhere, a client error, give up).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable

import grpc

from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.convert import (
    chunk_from_pb,
    flip_call_to_pb,
    flip_reply_from_pb,
    generate_call_to_pb,
    health_from_pb,
    load_from_pb,
    prefill_call_to_pb,
    prefill_reply_from_pb,
)
from splitserve.common.worker_messages import (
    CallErrorKind,
    FlipCall,
    FlipReply,
    GenerateCall,
    GenerateChunk,
    HealthReport,
    LoadReport,
    PrefillCall,
    PrefillReply,
    WorkerCallError,
)

GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class GrpcWorkerClient:
    """`WorkerClient` over the worker's gRPC service, on one channel."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._channel = grpc.aio.insecure_channel(endpoint, options=GRPC_OPTIONS)
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._early = True  # the worker serves PrefillEarly (until it answers that it does not)

    def generate(self, call: GenerateCall) -> _GrpcTokenStream:
        return _GrpcTokenStream(self._stub.Generate(generate_call_to_pb(call)))

    async def prefill(self, call: PrefillCall, timeout_s: float,
                      ticket: Awaitable[bytes] | None = None) -> PrefillReply:
        req = prefill_call_to_pb(call)
        deadline = time.monotonic() + timeout_s
        if ticket is not None and self._early:
            try:
                return await self._prefill_early(req, ticket, timeout_s)
            except WorkerCallError as e:
                if e.kind != "unimplemented":
                    raise
                self._early = False  # a worker older than PrefillEarly: the ticket goes with the request
        if ticket is not None:
            req.ticket = await ticket
        return await self._unary(self._stub.Prefill(req, timeout=max(0.0, deadline - time.monotonic())))

    async def _prefill_early(self, req: pb.PrefillRequest, ticket: Awaitable[bytes],
                             timeout_s: float) -> PrefillReply:
        async def messages() -> AsyncIterator[pb.PrefillStreamMessage]:
            yield pb.PrefillStreamMessage(request=req)
            yield pb.PrefillStreamMessage(ticket=await ticket)

        return await self._unary(self._stub.PrefillEarly(messages(), timeout=timeout_s))

    @staticmethod
    async def _unary(rpc) -> PrefillReply:
        try:
            resp = await rpc
        except grpc.aio.AioRpcError as e:
            raise _call_error(e) from None
        finally:
            rpc.cancel()  # a no-op once it ended; ends it when we are cancelled
        return prefill_reply_from_pb(resp)

    async def abort(self, request_id: str) -> bool:
        try:
            resp = await self._stub.Abort(pb.AbortRequest(request_id=request_id))
        except grpc.aio.AioRpcError as e:
            raise _call_error(e) from None
        return resp.found

    async def health(self, timeout_s: float) -> HealthReport:
        try:
            h = await self._stub.Health(pb.HealthRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _call_error(e) from None
        return health_from_pb(h)

    async def load(self, timeout_s: float) -> LoadReport:
        try:
            s = await self._stub.Stats(pb.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _call_error(e) from None
        return load_from_pb(s)

    async def flip(self, call: FlipCall, timeout_s: float) -> FlipReply:
        try:
            reply = await self._stub.Flip(flip_call_to_pb(call), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _call_error(e) from None
        return flip_reply_from_pb(reply)

    async def close(self) -> None:
        await self._channel.close()


class _GrpcTokenStream:
    def __init__(self, rpc: grpc.aio.UnaryStreamCall) -> None:
        self._rpc = rpc

    async def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        try:
            async for resp in self._rpc:
                yield chunk_from_pb(resp)
        except grpc.aio.AioRpcError as e:
            raise _call_error(e) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we are being cancelled (our caller left)
            # the call was cancelled under us (its channel closed): the worker is gone
            raise WorkerCallError("closed", "its connection closed") from None

    def cancel(self) -> None:
        self._rpc.cancel()


_KINDS: dict[grpc.StatusCode, CallErrorKind] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid", grpc.StatusCode.FAILED_PRECONDITION: "refused",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "cancelled", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.UNIMPLEMENTED: "unimplemented"}


def _call_error(e: grpc.aio.AioRpcError) -> WorkerCallError:
    return WorkerCallError(_KINDS.get(e.code(), "failed"), e.details() or e.code().name)

