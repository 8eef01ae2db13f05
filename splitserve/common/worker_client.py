"""What a caller asks of a worker, whatever carries it: generate, prefill, abort, health and load, in plain
dataclass messages (`WorkerClient`). `GrpcWorkerClient` carries them over the worker protocol; no protobuf type
leaves this module.

The gateway calls decode workers through it, and a decode worker calls its prefill peers through it (roles may
not import each other, so it lives in the bottom layer, next to the protocol it speaks). A failed call raises
`WorkerCallError`, whose `kind` is what a caller decides on (retry elsewhere, a client error, give up).

`generate` takes one `GenerateCall`; a later field is added there with a default, so no caller changes. Resume
tokens (a request moved after its first worker failed) go only to a worker whose health lists `resume`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import grpc

from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.convert import logprob_from_pb, params_to_pb
from splitserve.common.sampling import Logprob, SamplingParams

GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]

# invalid: the worker refused the request itself (a client error, never retried); unavailable: refused or reset
# connection; cancelled: the worker cancelled the call; closed: the call was cancelled under us (its channel
# closed); timeout: past the call's deadline; unimplemented: the worker does not serve that call (an older
# release); failed: anything else the worker answered
CAPABILITIES = frozenset({"resume"})  # what a worker may list in its health (others are ignored)
RETRY_REASONS = frozenset({"drain", "engine"})  # why a worker says a failed request may go on elsewhere

CallErrorKind = Literal["invalid", "unavailable", "cancelled", "closed", "timeout", "unimplemented", "failed"]


class WorkerCallError(Exception):
    """A call to a worker failed; `kind` says how, `details` is the worker's (or the transport's) message."""

    def __init__(self, kind: CallErrorKind, details: str) -> None:
        super().__init__(f"{kind}: {details}")
        self.kind = kind
        self.details = details


@dataclass(frozen=True)
class GenerateCall:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    prefill_worker: str = ""  # the prefill worker's name in membership ("": the decode worker prefills)
    priority: int = 0
    # output tokens produced elsewhere before (a moved request); `params` are already reduced by them
    resume_token_ids: Sequence[int] = ()


@dataclass
class GenerateChunk:
    """New tokens of one request, and where it stands (usage counts are totals so far)."""

    token_ids: list[int]
    logprobs: list[Logprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""  # "" until finished: stop | length | abort | error
    stop_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not computed for this request (cached, loaded or prefilled elsewhere)
    completion_tokens: int = 0
    error: str = ""
    remote_prefill: bool = False
    retry: str = ""  # with finish_reason error: the request may go on elsewhere, and why (drain | engine)


@dataclass(frozen=True)
class PrefillCall:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    ticket: bytes  # opaque: the decode side's handover ticket, read only by the prefill side's handover


@dataclass(frozen=True)
class PrefillReply:
    first_token_id: int
    first_logprob: Logprob | None
    cached_tokens: int
    kv_bytes: int
    receipt: bytes = b""  # opaque: the prefill side's answer for the decode side's handover (engine vllm)


@dataclass(frozen=True)
class HealthReport:
    live: bool  # its engine can still run steps
    ready: bool  # it takes requests
    role: str  # prefill | decode | both
    draining: bool
    model: str
    protocol_version: int
    engine: str = "native"  # native | vllm
    capabilities: frozenset[str] = frozenset()  # beyond protocol_version: "resume"
    kv_connector: str = ""  # engine vllm, disaggregated: layerwise | push | pull
    kv_transports: dict[str, str] = field(default_factory=dict)  # peer -> cuda_ipc | rdma | tcp | shm


@dataclass(frozen=True)
class LoadReport:
    """A worker's counters as of its engine's last step (requests, KV blocks, tokens)."""

    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_in_flight: int
    num_waiting_remote_kv: int
    num_held: int
    outstanding_requests: int


class TokenStream(Protocol):
    """One generate call's chunks; `cancel()` (safe at any time, also after the end) ends the call, which
    aborts the request on the worker."""

    def __aiter__(self) -> AsyncIterator[GenerateChunk]: ...

    def cancel(self) -> None: ...


class WorkerClient(Protocol):
    """One worker, as its callers see it. Every method raises `WorkerCallError` when the call fails."""

    endpoint: str

    def generate(self, call: GenerateCall) -> TokenStream: ...

    async def prefill(self, call: PrefillCall, timeout_s: float,
                      ticket: Awaitable[bytes] | None = None) -> PrefillReply:
        """With `ticket` (and `call.ticket` empty), the call goes out at once and the ticket follows when it
        resolves: the prefill worker computes meanwhile. To give the call up before its ticket, cancel it."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def health(self, timeout_s: float) -> HealthReport: ...

    async def load(self, timeout_s: float) -> LoadReport: ...

    async def close(self) -> None: ...


class GrpcWorkerClient:
    """`WorkerClient` over the worker's gRPC service, on one channel."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._channel = grpc.aio.insecure_channel(endpoint, options=GRPC_OPTIONS)
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._early = True  # the worker serves PrefillEarly (until it answers that it does not)

    def generate(self, call: GenerateCall) -> _GrpcTokenStream:
        req = pb.GenerateRequest(protocol_version=PROTOCOL_VERSION, request_id=call.request_id,
                                 prompt_token_ids=call.prompt_token_ids, params=params_to_pb(call.params),
                                 prefill_worker=call.prefill_worker, priority=call.priority,
                                 resume_token_ids=call.resume_token_ids)
        return _GrpcTokenStream(self._stub.Generate(req))

    async def prefill(self, call: PrefillCall, timeout_s: float,
                      ticket: Awaitable[bytes] | None = None) -> PrefillReply:
        req = pb.PrefillRequest(protocol_version=PROTOCOL_VERSION, request_id=call.request_id,
                                prompt_token_ids=call.prompt_token_ids, params=params_to_pb(call.params),
                                ticket=call.ticket)
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
        return PrefillReply(resp.first_token_id, logprob_from_pb(resp.first_logprob) if resp.has_logprob else None,
                            resp.cached_tokens, resp.kv_bytes, resp.receipt)

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
        return HealthReport(h.live, h.ready, h.role, h.draining, h.model, h.protocol_version,
                            h.engine if h.engine in ("native", "vllm") else "native",
                            frozenset(c for c in h.capabilities if c in CAPABILITIES),
                            h.kv_connector[:32], {k[:256]: v[:32] for k, v in list(h.kv_transports.items())[:256]})

    async def load(self, timeout_s: float) -> LoadReport:
        try:
            s = await self._stub.Stats(pb.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _call_error(e) from None
        return LoadReport(s.num_waiting, s.num_running, s.kv_blocks_used, s.kv_blocks_total, s.tokens_in_flight,
                          s.num_waiting_remote_kv, s.num_held, s.outstanding_requests)

    async def close(self) -> None:
        await self._channel.close()


class _GrpcTokenStream:
    def __init__(self, rpc: grpc.aio.UnaryStreamCall) -> None:
        self._rpc = rpc

    async def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        try:
            async for resp in self._rpc:
                yield GenerateChunk(
                    list(resp.token_ids), [logprob_from_pb(lp) for lp in resp.logprobs], resp.finished,
                    resp.finish_reason, resp.stop_reason, resp.prompt_tokens, resp.cached_tokens,
                    resp.completion_tokens, resp.error, resp.remote_prefill,
                    resp.retry if resp.retry in RETRY_REASONS else "engine" if resp.retry else "")
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
    grpc.StatusCode.INVALID_ARGUMENT: "invalid", grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "cancelled", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.UNIMPLEMENTED: "unimplemented"}


def _call_error(e: grpc.aio.AioRpcError) -> WorkerCallError:
    return WorkerCallError(_KINDS.get(e.code(), "failed"), e.details() or e.code().name)

