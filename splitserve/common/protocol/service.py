"""The Worker service on a gRPC server, answering a request (or a streamed request's message) that does not
decode with INVALID_ARGUMENT and one whose request id is in use with ALREADY_EXISTS.

grpc's own handlers turn any exception into UNKNOWN ("Unexpected DecodeError"), as if the worker had failed;
here these two reach the caller as what they are: a malformed message, a clash of ids.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from splitserve.common.protocol import RequestIdInUse
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc


class Undecodable:
    """A request whose bytes are not a message of its method's type."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class MalformedMessage(ValueError):
    """Raised by a streaming request's iterator for a message that does not decode (the caller's error)."""


def _lenient(deserialize):
    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except DecodeError as e:
            return Undecodable(str(e))

    return parse


async def _refuse(method: str, request: Undecodable, context) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed request ({request.reason})")


def _unary(method: str, behaviour):
    async def call(request, context):
        if isinstance(request, Undecodable):
            await _refuse(method, request, context)
        try:
            return await behaviour(request, context)
        except RequestIdInUse as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))

    return call


def _streaming(method: str, behaviour):
    async def call(request, context):
        if isinstance(request, Undecodable):
            await _refuse(method, request, context)
        try:
            async for out in behaviour(request, context):
                yield out
        except RequestIdInUse as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))

    return call


def _request_stream(method: str, behaviour):
    async def call(request_iterator, context):
        async def checked():
            async for msg in request_iterator:
                if isinstance(msg, Undecodable):
                    raise MalformedMessage(f"{method}: malformed message ({msg.reason})")
                yield msg

        try:
            return await behaviour(checked(), context)
        except MalformedMessage as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestIdInUse as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))

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


def add_worker_service(servicer: pb_grpc.WorkerServicer, server: grpc.aio.Server) -> None:
    """`add_WorkerServicer_to_server`, with undecodable requests refused as INVALID_ARGUMENT and clashing
    request ids as ALREADY_EXISTS."""
    got = _Handlers()
    pb_grpc.add_WorkerServicer_to_server(servicer, got)
    methods = {}
    for name, h in got.methods.items():
        if h.request_streaming:
            assert not h.response_streaming, name  # no Worker method streams both ways
            h = h._replace(stream_unary=_request_stream(name, h.stream_unary))
        elif h.response_streaming:
            h = h._replace(unary_stream=_streaming(name, h.unary_stream))
        else:
            h = h._replace(unary_unary=_unary(name, h.unary_unary))
        methods[name] = h._replace(request_deserializer=_lenient(h.request_deserializer))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(got.service, methods),))
    server.add_registered_method_handlers(got.service, methods)
