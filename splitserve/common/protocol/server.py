"""The worker's side of the wire: a `WorkerHandler` (a worker's calls in the dataclass messages of
`splitserve.common.worker_messages`) served over gRPC (grpc.aio). The one place where a worker meets gRPC.

Every message received is converted and validated here (`convert`); a request that does not decode, or fails
validation, is refused with INVALID_ARGUMENT before the handler sees it. The errors a handler raises
(`WorkerError`) become status codes: `InvalidRequest` INVALID_ARGUMENT, `RequestIdInUse` ALREADY_EXISTS,
`NotServed` and `FlipRefused` FAILED_PRECONDITION, `TransferFailed`, `NotReady` and `Draining` UNAVAILABLE. (grpc's own handlers
would turn any exception into UNKNOWN, as if the worker had failed.)
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError

from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.convert import (
    chunk_to_pb,
    flip_call_from_pb,
    flip_reply_to_pb,
    generate_call_from_pb,
    health_to_pb,
    load_to_pb,
    prefill_call_from_pb,
    prefill_reply_to_pb,
)
from splitserve.common.tasks import settle
from splitserve.common.worker_messages import (
    Draining,
    FlipCall,
    FlipRefused,
    FlipReply,
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
    TransferFailed,
    WorkerError,
)
from splitserve.common.worker_metrics import WORKER_REQUESTS

# no SO_REUSEPORT: a second process on a worker's port must fail to start, not share its traffic
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", 0)]

_STATUS: dict[type[WorkerError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT, RequestIdInUse: grpc.StatusCode.ALREADY_EXISTS,
    NotServed: grpc.StatusCode.FAILED_PRECONDITION, FlipRefused: grpc.StatusCode.FAILED_PRECONDITION,
    TransferFailed: grpc.StatusCode.UNAVAILABLE,
    NotReady: grpc.StatusCode.UNAVAILABLE, Draining: grpc.StatusCode.UNAVAILABLE}

M = TypeVar("M")


class WorkerHandler(Protocol):
    """A worker's calls, as the gRPC server hands them over. Each raises a `WorkerError` to refuse or fail."""

    def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]: ...

    async def prefill(self, call: PrefillCall) -> PrefillReply: ...

    async def prefill_early(self, call: PrefillCall, ticket: Awaitable[bytes]) -> PrefillReply:
        """`call.ticket` is empty; `ticket` resolves once the caller sent it, or raises `InvalidRequest` (what
        came is not a ticket) or `TransferFailed` (the call ended before it came)."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    def health(self) -> HealthReport: ...

    def load(self) -> LoadReport: ...

    async def flip(self, call: FlipCall) -> FlipReply:
        """Serve `call.role` on the same engine; answers once it does (`FlipRefused` when it cannot)."""
        ...


class GrpcWorkerServer:
    """A `WorkerHandler` on a gRPC server of its own."""

    def __init__(self, handler: WorkerHandler) -> None:
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        add_worker_service(handler, self._server)

    async def start(self, address: str) -> None:
        """Listen at `address` (host:port); OSError (EADDRINUSE) when it cannot."""
        try:
            self._server.add_insecure_port(address)
        except RuntimeError as e:  # grpc: "Failed to bind to address ..."
            raise OSError(errno.EADDRINUSE, f"cannot listen on {address}") from e
        await self._server.start()

    async def stop(self, grace: float | None) -> None:
        """Stop taking calls; those in flight get `grace` seconds (None: none) before they are cancelled."""
        await self._server.stop(grace)


class _Servicer(pb_grpc.WorkerServicer):
    """Each method: the request converted and validated, the handler's call, its answer converted back."""

    def __init__(self, handler: WorkerHandler) -> None:
        self.handler = handler

    async def Generate(self, request, context):
        call = await _convert(generate_call_from_pb, request, "generate", context)
        try:
            async for chunk in self.handler.generate(call):
                yield chunk_to_pb(chunk)
        except WorkerError as e:
            await _refuse(e, context)

    async def Prefill(self, request, context):
        call = await _convert(prefill_call_from_pb, request, "prefill", context)
        try:
            reply = await self.handler.prefill(call)
        except WorkerError as e:
            await _refuse(e, context)
        return prefill_reply_to_pb(call.request_id, reply)

    async def PrefillEarly(self, request_iterator, context):
        """The request first, then its ticket: the handler starts on the request while the ticket is read."""
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if isinstance(first, _Undecodable):
            await _refuse(_malformed("PrefillEarly: malformed message", first), context)
        if first is None or first.WhichOneof("body") != "request":
            WORKER_REQUESTS.labels("prefill", "invalid").inc()
            await _refuse(InvalidRequest("PrefillEarly: the first message must be the request"), context)
        call = await _convert(prefill_call_from_pb, first.request, "prefill", context)
        ticket: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        reader = asyncio.ensure_future(_read_ticket(messages, ticket))
        try:
            reply = await self.handler.prefill_early(call, ticket)
        except WorkerError as e:
            await _refuse(e, context)
        finally:
            reader.cancel()
            settle(ticket)  # the call's outcome already says what failed
        return prefill_reply_to_pb(call.request_id, reply)

    async def Abort(self, request, context):
        try:
            return pb.AbortResponse(found=await self.handler.abort(request.request_id))
        except WorkerError as e:
            await _refuse(e, context)

    async def Health(self, request, context):
        return health_to_pb(self.handler.health())

    async def Stats(self, request, context):
        try:
            return load_to_pb(self.handler.load())
        except WorkerError as e:
            await _refuse(e, context)

    async def Flip(self, request, context):
        call = await _convert(flip_call_from_pb, request, "flip", context)
        try:
            return flip_reply_to_pb(await self.handler.flip(call))
        except WorkerError as e:
            await _refuse(e, context)


async def _convert(convert: Callable[[Any], M], request, rpc: str, context) -> M:
    """The request as a dataclass; refused (INVALID_ARGUMENT, counted) when a field fails validation."""
    try:
        return convert(request)
    except InvalidRequest as e:
        WORKER_REQUESTS.labels(rpc, "invalid").inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


async def _refuse(e: WorkerError, context) -> None:
    await context.abort(_STATUS.get(type(e), grpc.StatusCode.INTERNAL), str(e))


async def _read_ticket(messages: AsyncIterator, ticket: asyncio.Future[bytes]) -> None:
    """PrefillEarly's second message: its ticket, or why none came, into `ticket`."""
    try:
        msg = await anext(messages, None)
    except (grpc.RpcError, asyncio.CancelledError) as e:  # the call ended under us
        if not ticket.done():
            ticket.set_exception(TransferFailed(f"the ticket never came: {e!r}"))
        return
    if isinstance(msg, _Undecodable):
        ticket.set_exception(_malformed("PrefillEarly: malformed message", msg))
    elif msg is None or msg.WhichOneof("body") != "ticket":  # a caller that gives up cancels the call
        ticket.set_exception(InvalidRequest("PrefillEarly: the second message must be the ticket"))
    else:
        ticket.set_result(msg.ticket)


# == registration: requests that do not decode ==================================================================
class _Undecodable:
    """A request whose bytes are not a message of its method's type."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(deserialize):
    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except DecodeError as e:
            return _Undecodable(str(e))

    return parse


def _malformed(what: str, item: _Undecodable) -> InvalidRequest:
    return InvalidRequest(f"{what} ({item.reason})")


def _unary(method: str, behaviour):
    async def call(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(_malformed(f"{method}: malformed request", request), context)
        return await behaviour(request, context)

    return call


def _streaming(method: str, behaviour):
    async def call(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(_malformed(f"{method}: malformed request", request), context)
        async for out in behaviour(request, context):
            yield out

    return call


class _Handlers:
    """Stands in for the server while the generated code registers its handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.methods: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, methods: dict) -> None:
        self.service, self.methods = service, methods


def add_worker_service(handler: WorkerHandler, server: grpc.aio.Server) -> None:
    """The Worker service on `server`, answering from `handler`; a request (or a streamed request's message)
    that does not decode is refused as INVALID_ARGUMENT."""
    got = _Handlers()
    pb_grpc.add_WorkerServicer_to_server(_Servicer(handler), got)
    methods = {}
    for name, h in got.methods.items():
        if h.request_streaming:  # its method checks each message as it reads it
            assert not h.response_streaming, name  # no Worker method streams both ways
        elif h.response_streaming:
            h = h._replace(unary_stream=_streaming(name, h.unary_stream))
        else:
            h = h._replace(unary_unary=_unary(name, h.unary_unary))
        methods[name] = h._replace(request_deserializer=_lenient(h.request_deserializer))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(got.service, methods),))
    server.add_registered_method_handlers(got.service, methods)
