"""The worker protocol in plain Python, the same on both sides of the wire: the dataclass messages of each call
(generate, prefill, health, load, flip), `WorkerClient` (what a caller asks of a worker), the errors a worker's side
raises (`WorkerError`: the wire adapter maps each to a status code) and the one a caller sees
(`WorkerCallError`), and `RetryReason`, why a failed stream may move to another worker.

No transport here: `worker_client.GrpcWorkerClient` carries these messages for a caller, `protocol.server` for a
worker; the role services and the gateway see only this module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol

from splitserve.common.sampling import Logprob, SamplingParams

CAPABILITIES = frozenset({"resume"})  # what a worker may list in its health (others are ignored)


class RetryReason(StrEnum):
    """Why a request that failed on one decode worker may go on on another (the `reason` label of
    `splitserve_router_migrations_total`). A worker gives the last three on the final chunk of the stream it
    failed; the gateway sees the first two itself. `busy` is a bounce, not a move: the gateway tries another
    decode worker, or this one again after a pause (`splitserve_router_busy_retries_total`)."""

    WORKER_GONE = "worker_gone"  # the call failed (connection refused, reset or closed) or ended without a finish
    STALL = "stall"  # no token for router.stallSeconds
    DRAIN = "drain"  # the worker's drain time ran out
    ENGINE = "engine"  # the worker's engine stopped: the engine, not the request, failed
    BUSY = "busy"  # before its first token: the decode worker had no KV room for the prompt in time (try another)


# == messages ===================================================================================================
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

    request_id: str
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
    retry: RetryReason | None = None  # with finish_reason error or abort: the request may go on elsewhere, and why


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


@dataclass(frozen=True)
class FlipCall:
    """Serve `role` instead of the worker's role, on the same engine (a role flip)."""

    role: str  # prefill | decode
    # s its requests in flight may finish before its streams move to other decode workers (0: at once); a
    # prefill worker's prefills always finish (they cannot move)
    drain_seconds: float = 1.0


@dataclass(frozen=True)
class FlipReply:
    role: str  # the role it serves now
    previous: str  # the role it left
    seconds: float  # from the call to serving `role` (registered under it)
    moved_streams: int  # streams that moved to other decode workers


ROLE_FLIP_ROLES = ("prefill", "decode")
MAX_FLIP_DRAIN_SECONDS = 3600.0


# == the worker's side: what its calls raise ====================================================================
class WorkerError(Exception):
    """A call the worker refuses or fails; the message says why, as the caller will read it."""


class InvalidRequest(WorkerError, ValueError):
    """The request is the caller's error (a field out of range, a ticket that does not fit); the message names
    the field. Never retried."""


class RequestIdInUse(WorkerError, ValueError):
    """A request id that a request in flight on this worker already has."""


class TransferFailed(WorkerError):
    """A prefill's KV transfer failed (the handover stopped writing into the ticket's blocks before raising)."""


class NotReady(WorkerError):
    """The worker is still loading its model."""


class Draining(WorkerError):
    """The worker is draining: it takes nothing new (the caller tries another worker)."""


class NotServed(WorkerError):
    """A call this worker's role does not serve (generate on a prefill worker)."""


class FlipRefused(WorkerError):
    """A role flip this worker cannot make (it serves that role already, it is colocated, no registry, its
    engine cannot serve the other role, another flip is under way); the message says why."""


def check_prompt(prompt: Sequence[int], resume: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Raises `InvalidRequest` unless a request fits the model it runs on: its prompt, and after it the output
    it produced elsewhere before (`resume`, a moved request), within the context length and the vocabulary."""
    if not prompt:
        raise InvalidRequest("prompt_token_ids: empty")
    if len(prompt) >= max_model_len:
        raise InvalidRequest(f"prompt_token_ids: {len(prompt)} tokens, context length is {max_model_len}")
    if max(prompt) >= vocab_size:
        raise InvalidRequest(f"prompt_token_ids: ids must be below the vocabulary size {vocab_size}")
    if not resume:
        return
    if len(prompt) + len(resume) >= max_model_len:
        raise InvalidRequest(f"resume_token_ids: {len(prompt)} + {len(resume)} tokens, context length is "
                             f"{max_model_len}")
    if max(resume) >= vocab_size:
        raise InvalidRequest(f"resume_token_ids: ids must be below the vocabulary size {vocab_size}")


# == the caller's side ==========================================================================================
# invalid: the worker refused the request itself (a client error, never retried); refused: the worker cannot do
# that in its role or state (not served, a flip it cannot make); unavailable: refused or reset connection;
# cancelled: the worker cancelled the call; closed: the call was cancelled under us (its channel closed);
# timeout: past the call's deadline; unimplemented: the worker does not serve that call (an older release);
# failed: anything else the worker answered
CallErrorKind = Literal["invalid", "refused", "unavailable", "cancelled", "closed", "timeout", "unimplemented",
                        "failed"]


class WorkerCallError(Exception):
    """A call to a worker failed; `kind` says how, `details` is the worker's (or the transport's) message."""

    def __init__(self, kind: CallErrorKind, details: str) -> None:
        super().__init__(f"{kind}: {details}")
        self.kind = kind
        self.details = details


class TokenStream(Protocol):
    """One generate call's chunks; `cancel()` (safe at any time, also after the end) ends the call, which
    aborts the request on the worker."""

    def __aiter__(self) -> AsyncIterator[GenerateChunk]: ...

    def cancel(self) -> None: ...


class WorkerClient(Protocol):
    """One worker, as its callers see it. Every method raises `WorkerCallError` when the call fails.

    `generate` takes one `GenerateCall`; a later field is added there with a default, so no caller changes.
    Resume tokens (a request moved after its first worker failed) go only to a worker whose health lists
    `resume`."""

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

    async def flip(self, call: FlipCall, timeout_s: float) -> FlipReply:
        """Answers once the worker serves `call.role`; a call that times out leaves the flip running to its end
        (calling again for the same role waits for it)."""
        ...

    async def close(self) -> None: ...
