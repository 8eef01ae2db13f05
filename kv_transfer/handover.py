"""The native engine's side of the KV handover seam (`engine.interface.DecodeHandover` / `PrefillHandover`):
the transfer agent, the layer hook that streams each layer as it is written, the KV pool and the engine's
block-level calls, behind an opaque ticket (a `TransferTicket`'s bytes).

Decode (`NativeDecodeHandover`): `reserve` takes blocks in the engine and publishes a ticket naming them;
`landed` waits for the agent; `admit` joins the request to the batch. It owns the reserved blocks until then:
after `cancel`, they are freed only once the prefill call has ended and the agent says no write of the
transfer can land any more (`KVTransferAgent.quiet`), in that order, with no timer in between.

Prefill (`NativePrefillHandover`): `run` computes the prompt with its blocks held, streams each layer's KV into
the ticket's blocks as the layer is written, waits for the sender to finish, and releases the blocks to the
prefix cache (behind the reply when it succeeded). The ticket may come after the compute began (the decode side
reserves while the prompt is computed): layers written before it are sent when it comes. Under tensor
parallelism the compute waits for it (every rank plans its sends from the step that carries the ticket's plan).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Sequence

from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.common.tasks import TaskOwner, settle
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.interface import BadTicket, PrefillResult, Reservation
from splitserve.engine.kv_cache_manager import cdiv
from splitserve.engine.outputs import RequestOutput
from splitserve.kv_transfer.agent import KVTransferAgent, SendSession
from splitserve.kv_transfer.errors import TransferError
from splitserve.kv_transfer.pool import KVPool
from splitserve.kv_transfer.sharded import ShardedReceiver, ShardedSender
from splitserve.kv_transfer.stream_hook import KVStreamHook
from splitserve.kv_transfer.ticket import TransferTicket

log = logging.getLogger("splitserve.kv_transfer.handover")
# SPLITSERVE_PREFILL_EARLY=0: the decode worker sends the prefill call after reserving, with the ticket (to compare)
PREFILL_EARLY = os.environ.get("SPLITSERVE_PREFILL_EARLY", "1") != "0"
# s a closing handover waits for its pending frees and releases (a worker that flips keeps its engine: what is
# not freed stays held); a free waits for its prefill call and the transfer's quiet, both bounded by the
# transfer's deadline, which is normally over long before
CLOSE_WAIT_S = 10.0


class NativeDecodeHandover:
    streams_first_token = False  # the prefill's first token goes out as soon as the KV landed
    overlap_reserve = PREFILL_EARLY  # taking blocks and publishing their ticket costs a millisecond or two

    def __init__(self, engine: AsyncEngine, agent: KVTransferAgent | ShardedReceiver) -> None:
        self.engine = engine
        self.agent = agent
        self.block_size = engine.kv_spec.block_size
        self._tasks = TaskOwner("handover")  # deferred frees

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      priority: int = 0, *, min_remote_tokens: int = 1, timeout_s: float = 30.0) -> Reservation:
        reserved = await self.engine.reserve_remote(request_id, prompt_token_ids, params, priority)
        if reserved is None:
            return Reservation(None, 0, "no_free_blocks")
        block_ids, cached = reserved
        if len(prompt_token_ids) - cached < min_remote_tokens:  # mostly cached here: not worth a transfer
            await self.engine.abort(request_id)
            return Reservation(None, cached, "short_prompt")
        ticket = self.agent.expect(request_id, block_ids, skip_blocks=cached // self.block_size, timeout_s=timeout_s)
        return Reservation(ticket.encode(), cached)

    async def landed(self, request_id: str) -> None:
        await self.agent.wait(request_id)  # TransferError: the caller cancels
        self.agent.forget(request_id)

    def admit(self, request_id: str, first_token_id: int, first_logprob: Logprob | None = None,
              receipt: bytes = b"") -> AsyncIterator[RequestOutput]:
        return self.engine.stream_remote(request_id, first_token_id, first_logprob)

    def cancel(self, request_id: str, prefill: Awaitable[object] | None = None) -> None:
        self.agent.cancel(request_id)  # no new write is taken from here on
        self.agent.forget(request_id)
        self._tasks.spawn(self._free(request_id, prefill), f"free {request_id}")

    async def _free(self, request_id: str, prefill: Awaitable[object] | None) -> None:
        """Free the reservation once the prefill call has ended (its sender was told to stop) and no write of
        the transfer can land any more (the agent's word: frames in progress done, or each sender stopped)."""
        if prefill is not None:
            await asyncio.wait({asyncio.ensure_future(prefill)})  # its outcome is the caller's; only its end here
        await self.agent.quiet(request_id)
        await self.engine.abort(request_id)

    async def close(self) -> None:
        """Frees still pending go first (the engine may go on serving another role after a flip), then the rest
        of the transfers."""
        await _finish(self._tasks, "reservations not freed yet")
        self.agent.close()


class NativePrefillHandover:
    def __init__(self, engine: AsyncEngine, agent: KVTransferAgent | ShardedSender, hook: KVStreamHook,
                 pool: KVPool | None = None) -> None:
        self.engine = engine
        self.agent = agent
        self.hook = hook
        self.pool = pool  # prompts' blocks already in the KV pool are loaded, not computed
        self._tasks = TaskOwner("prefill")  # block releases queued behind replies

    def _ticket(self, data: bytes, request_id: str, num_prompt_tokens: int) -> TransferTicket:
        ticket = TransferTicket.decode(data)  # MalformedTicket is a BadTicket
        ticket.check_compatible(self.agent.layout)
        if ticket.request_id != request_id:
            raise BadTicket("ticket.request_id differs from request_id")
        need = cdiv(num_prompt_tokens, self.engine.kv_spec.block_size)
        if len(ticket.block_ids) != need:
            raise BadTicket(f"ticket has {len(ticket.block_ids)} blocks, the prompt needs {need}")
        return ticket

    async def run(self, ticket: Awaitable[bytes], request_id: str, prompt_token_ids: Sequence[int],
                  params: SamplingParams) -> PrefillResult:
        rid = request_id
        came: list[TransferTicket] = []  # the ticket, once it came and fits
        scheduled = 0.0

        def begin(blocks: list[int]) -> SendSession | None:  # on the engine thread, from the request's first step
            nonlocal scheduled
            scheduled = scheduled or time.monotonic()
            return self.agent.begin(came[0], blocks) if came else None  # None: the layers wait for the ticket

        async def take_ticket() -> TransferTicket:
            tt = self._ticket(await ticket, rid, len(prompt_token_ids))  # MalformedTicket is a BadTicket
            came.append(tt)
            self.hook.attach(rid)  # sends what was computed before it came
            return tt

        done = self.hook.register(rid, begin, len(prompt_token_ids))
        arrival = asyncio.ensure_future(take_ticket())
        sent = False
        try:
            if isinstance(self.agent, ShardedSender):  # follower ranks plan their sends at each step: ticket first
                await arrival
            first = None
            async for out in (self.pool or self.engine).generate(rid, prompt_token_ids, params, hold_blocks=True):
                first = out
            if first is None or first.finish_reason in ("abort", "error") or not first.new_token_ids:
                raise TransferError(f"{rid}: prefill did not produce a token ({first and first.error})")
            tt = await arrival  # the prompt is computed: what is left waits for the ticket
            await done.wait_async(max(0.5, tt.deadline - time.time()))
            computed = time.monotonic()
            error = self.hook.error(rid)
            session = self.hook.session(rid)
            if error is not None or session is None:
                if isinstance(error, BadTicket):  # found only once streaming began: a failed transfer
                    raise TransferError(str(error)) from error
                raise error or TransferError(f"{rid}: no KV stream was started")
            await asyncio.to_thread(session.finish)
            finished = time.monotonic()
            sent = True
        finally:
            settle(arrival)  # a failure that matters was raised above
            if not sent:  # failed or cancelled (the decode worker gave up): stop writing into its blocks
                session = self.hook.session(rid)
                if session is not None:
                    session.abort()
            self.hook.unregister(rid)
            if sent:  # the reply need not wait for the engine's step in progress: release behind it
                self._tasks.spawn(self.engine.release(rid), f"release {rid}")
            else:
                await self.engine.release(rid)
        lp = first.new_logprobs[0] if first.new_logprobs else None
        return PrefillResult(first.new_token_ids[0], lp, first.num_cached_tokens, session.bytes, scheduled, computed,
                             finished)

    async def close(self) -> None:
        """The hook leaves the engine with it (the worker may go on in the decode role: no per-layer hook left
        then, so its decode steps may overlap again)."""
        await _finish(self._tasks, "prefilled requests not released yet")
        self.engine.remove_layer_hook(self.hook)
        if self.pool is not None:
            await self.pool.close()
        self.agent.close()


async def _finish(tasks: TaskOwner, what: str) -> None:
    """A handover's pending work (frees, releases) ends before it closes, up to CLOSE_WAIT_S; the rest is cut
    (the engine keeps those requests' blocks until it stops)."""
    left = await tasks.wait(CLOSE_WAIT_S)
    if left:
        log.warning("closing the handover with %d %s after %.0f s", left, what, CLOSE_WAIT_S)
    await tasks.close()
