"""The seams between the roles and an engine: what a role may ask of any engine, and nothing more.

- `ServingEngine`: model facts, generate, abort, stats, shutdown, and the KV block events (every engine has a
  prefix cache, and the cluster's KV index is built from its events, whichever role runs it).
- The KV handover, its own pair: the decode side (`DecodeHandover`: reserve → opaque ticket, landed, admit,
  cancel) and the prefill side (`PrefillHandover`: run with a ticket). The ticket is bytes the two sides'
  implementations agree on; the roles only carry it.

No engine's internals (block ids, KV tensors, layer hooks) cross these protocols: the native engine
(`AsyncEngine`) and its KV transfer (`kv_transfer.handover`) implement them, and keep their own
engine-specific calls off them (the layer hooks are `engine.layer_hooks`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from splitserve.common.kv_events import KVCacheEvent
from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.engine.outputs import RequestOutput


@dataclass(frozen=True)
class ModelFacts:
    """The served model as the roles see it."""

    name: str  # the served model name; also the salt of its block hashes
    vocab_size: int
    max_model_len: int  # tokens (prompt + output)
    eos_token_ids: frozenset[int]
    tensor_parallel_size: int
    device: str  # cpu | cuda:N
    block_size: int = 16  # tokens per KV block (the unit of its block hashes and events)
    num_kv_blocks: int = 0  # KV blocks of its cache (capacity, as the router's load view counts it)


KVEventListener = Callable[[KVCacheEvent], None]


class ServingEngine(Protocol):
    """The engine as a role uses it (everything async runs on the role's loop)."""

    facts: ModelFacts
    dead: bool  # no step can run any more (the worker should be restarted)

    def add_kv_event_listener(self, listener: KVEventListener) -> None:
        """Called on the engine's thread with every BlockStored / BlockRemoved / AllBlocksCleared; must not block."""
        ...

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iterator early (or cancellation) aborts it."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, int]:
        """Counters as of the engine's last step (never waits for a step to end)."""
        ...

    def shutdown(self) -> None: ...


# == the KV handover ============================================================================================
class HandoverFailed(Exception):
    """A remote prefill's KV did not arrive (peer gone, deadline, bad data): the decode side prefills locally."""


class BadTicket(HandoverFailed, ValueError):
    """A ticket that does not parse, or does not fit this engine or this request (a caller's error)."""


@dataclass(frozen=True)
class Reservation:
    """The decode side's answer to `reserve`: a ticket for the prefill side, or why it prefills locally."""

    ticket: bytes | None  # opaque; None: nothing is reserved (see `refused`)
    num_cached_tokens: int = 0  # prompt tokens this engine already holds (its prefix cache)
    refused: Literal["", "no_free_blocks", "short_prompt"] = ""


class DecodeHandover(Protocol):
    """The decode side: reserve room for a prompt's KV, learn when it landed, then admit the request.

    It owns the reserved blocks from `reserve` on: after `cancel` it frees them once the prefill call has ended
    and no write of the transfer can land any more (never earlier), so the caller never waits for that.

    Two shapes fit it: a push (native: the prefill side writes into reserved blocks; `landed` says when) and a
    pull (vLLM: nothing is reserved, the prefill side's `receipt` tells the decode engine where to read the KV
    from when `admit` starts it). `streams_first_token` says which: when true, `admit`'s stream produces the
    first token itself, so the prefill's token is not sent ahead of it.
    """

    streams_first_token: bool
    # True when `reserve` takes long enough to overlap with the prefill call: the call goes out first and its
    # ticket follows (the prefill side needs it only to send the KV)
    overlap_reserve: bool

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      priority: int = 0, *, min_remote_tokens: int = 1, timeout_s: float = 30.0) -> Reservation:
        """Reserve blocks and publish a ticket, valid for `timeout_s`, when at least `min_remote_tokens` prompt
        tokens would arrive from outside; otherwise reserve nothing."""
        ...

    async def landed(self, request_id: str) -> None:
        """Until the reserved request's KV landed; raises `HandoverFailed` (then `cancel` it)."""
        ...

    def admit(self, request_id: str, first_token_id: int, first_logprob: Logprob | None = None,
              receipt: bytes = b"") -> AsyncIterator[RequestOutput]:
        """The KV landed: the request joins the batch after `first_token_id`; streams its outputs from there
        (its first output repeats that token). `receipt`: the prefill side's, as it returned it."""
        ...

    def cancel(self, request_id: str, prefill: Awaitable[object] | None = None) -> None:
        """Give the reservation up (at any point before `admit`). Its blocks are freed once `prefill` (the
        prefill call's task or future, if one was made; the caller cancels it or has its outcome) has ended and
        the transfer can no longer write; returns at once."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprob: Logprob | None
    num_cached_tokens: int  # prompt tokens the prefill side found cached (not computed)
    kv_bytes: int  # bytes sent
    # time.monotonic() marks, seconds: first scheduled, prompt computed (every layer queued), every write done
    scheduled: float
    computed: float
    sent: float
    receipt: bytes = b""  # for the decode side's `admit` (opaque; empty when the KV is already in its blocks)


class PrefillHandover(Protocol):
    """The prefill side: compute a prompt and put its KV where the ticket says."""

    async def run(self, ticket: Awaitable[bytes], request_id: str, prompt_token_ids: Sequence[int],
                  params: SamplingParams) -> PrefillResult:
        """Computes the prompt from the start; `ticket` may resolve later (the decode side reserves meanwhile),
        and the KV goes where it says once it has. Raises `BadTicket` when the ticket does not fit (nothing was
        sent), `HandoverFailed` when the prompt or its transfer failed, or the ticket never came; cancelled, it
        stops writing into the ticket's blocks."""
        ...

    async def close(self) -> None: ...



class Closeable(Protocol):
    async def close(self) -> None: ...


@dataclass(frozen=True)
class DecodeSide:
    """What an engine gives a decode (or colocated) worker's service: the engine it serves from (a KV pool's
    front, say), its handover (None on a colocated worker, which prefills locally) and what the service closes
    with it. Each engine's `handovers` module (`splitserve.common.engines`) assembles one."""

    engine: ServingEngine
    handover: DecodeHandover | None
    resources: Sequence[Closeable] = ()
