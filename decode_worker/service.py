"""Generate on a decode worker: reserve room for the uncached part of the prompt's KV (the handover's
opaque ticket), have the named prefill worker compute it and put its KV there, then decode from the first token
it returns. Where reserving takes time (`DecodeHandover.overlap_reserve`), the prefill call goes out first and the
ticket follows it: the prefill worker computes while this worker reserves.

Short prompts (or no prefill worker) are prefilled locally. If the prefill worker fails, stalls past the
transfer deadline or dies, the request is prefilled locally instead and still succeeds; the handover frees
the reservation once the prefill call has ended and no write of the transfer can land any more. A long prompt
that finds no KV room here is never prefilled locally: the worker waits for blocks to free, up to
`decode.reserveWaitSeconds`, then sends it back to the gateway as busy (`room`).

Each remote prefill that succeeds leaves a timeline of its handover (`HandoverTimeline`): a time.monotonic()
mark at the end of each stage, observed in `splitserve_handover_stage_seconds{stage}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from splitserve.common.membership import Membership
from splitserve.common.tasks import TaskOwner, settle
from splitserve.common.worker_messages import (
    GenerateCall,
    GenerateChunk,
    InvalidRequest,
    PrefillCall,
    PrefillReply,
    RetryReason,
    WorkerCallError,
    WorkerClient,
    check_prompt,
)
from splitserve.common.worker_metrics import PREFIX_HIT_TOKENS, PROMPT_TOKENS, WORKER_REQUESTS
from splitserve.decode_worker.metrics import LOCAL_PREFILL, REMOTE_PREFILL, HandoverTimeline
from splitserve.decode_worker.room import NoRoom, reserve_when_room
from splitserve.engine.interface import DecodeHandover, HandoverFailed, ServingEngine
from splitserve.engine.outputs import RequestOutput

log = logging.getLogger("splitserve.decode_worker")


class Closeable(Protocol):
    async def close(self) -> None: ...


class DecodeService:
    """Generate on a decode worker (a handover and prefill peers) or a colocated one (none: always local).

    `engine.generate` prefills locally (the native assembly passes one that loads from the KV pool first);
    `connect` makes the client of the prefill worker at an endpoint; `resources` are closed with the service
    (the KV pool)."""

    def __init__(self, engine: ServingEngine, handover: DecodeHandover | None, membership: Membership,
                 connect: Callable[[str], WorkerClient], threshold: int = 512, transfer_timeout: float = 30.0,
                 resources: Sequence[Closeable] = (), reserve_wait: float = 1.0) -> None:
        self.role = "decode" if handover is not None else "both"
        self.engine = engine
        self.handover = handover
        self.membership = membership
        self.threshold = threshold
        self.transfer_timeout = transfer_timeout
        self.reserve_wait = reserve_wait  # s a remote prefill may wait for KV room here before it goes back as busy
        self.resources = list(resources)
        self.connect = connect
        self._peers: dict[str, WorkerClient] = {}  # endpoint -> client
        self._warned: set[str] = set()
        self._tasks = TaskOwner("decode")

    def _peer(self, name: str) -> str | None:
        """The endpoint of prefill peer `name`, if membership has it (a name from the router, never an address)."""
        for w in self.membership.workers():
            if w.name == name and w.role == "prefill" and not w.draining:
                return w.endpoint
        return None

    def _client(self, endpoint: str) -> WorkerClient:
        client = self._peers.get(endpoint)
        if client is None:
            client = self._peers[endpoint] = self.connect(endpoint)
        return client

    def _has_peers(self) -> bool:
        return self.handover is not None and any(w.role == "prefill" for w in self.membership.workers())

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        """The request's chunks; raises `InvalidRequest` when it does not fit the model."""
        received = time.monotonic()
        facts = self.engine.facts
        try:
            check_prompt(call.prompt_token_ids, call.resume_token_ids, facts.vocab_size, facts.max_model_len)
        except InvalidRequest:
            WORKER_REQUESTS.labels("generate", "invalid").inc()
            raise
        peer = None
        if call.prefill_worker and self.handover is not None:
            peer = self._peer(call.prefill_worker)
            if peer is None:  # not (or not yet, or no longer) a peer: never an address from a client
                LOCAL_PREFILL.labels("unknown_prefill_worker").inc()
        # a moved request continues after the output it produced elsewhere: the engine sees it as context
        resumed = len(call.resume_token_ids)
        prompt = list(call.prompt_token_ids) + list(call.resume_token_ids)
        rid, params = call.request_id, call.params
        stream: AsyncIterator[RequestOutput] | None = None
        remote = False
        timeline: HandoverTimeline | None = None  # a remote prefill that succeeded, until its first decode
        if peer is not None and len(prompt) >= self.threshold:
            timeline = HandoverTimeline(received)
            try:
                stream, remote = await self._remote(rid, prompt, params, call.priority, peer, timeline)
            except NoRoom as e:  # back to the gateway, which tries another decode worker or this one later
                WORKER_REQUESTS.labels("generate", "busy").inc()
                yield GenerateChunk(rid, [], finished=True, finish_reason="error", error=str(e),
                                    retry=RetryReason.BUSY)
                return
            if not remote:
                timeline = None
        elif peer is not None or (self._has_peers() and not call.prefill_worker):
            LOCAL_PREFILL.labels("short_prompt" if peer is not None else "no_prefill_worker").inc()
        if stream is None:
            stream = self.engine.generate(rid, prompt, params, call.priority)
        first = True
        async for out in stream:
            if first:
                first = False
                if timeline is not None:
                    timeline.observe_first_token(time.monotonic())
                PROMPT_TOKENS.inc(out.num_prompt_tokens)
                PREFIX_HIT_TOKENS.inc(out.num_cached_tokens)
            elif timeline is not None and out.new_token_ids:  # the first decoded token ends the timeline
                timeline.observe_first_decode(time.monotonic())
                timeline = None
            if out.finished:  # counted before the last message: the caller may hang up once it has it
                WORKER_REQUESTS.labels("generate", "ok" if out.finish_reason in ("stop", "length") else
                                       out.finish_reason or "error").inc()
            yield self._chunk(out, remote, resumed)

    async def _remote(self, rid, prompt, params, priority, peer,
                      timeline: HandoverTimeline) -> tuple[AsyncIterator[RequestOutput] | None, bool]:
        """Remote prefill: (its stream, True); (the local fallback's stream, False) when the transfer failed;
        (None, False) means prefill locally (the reason is counted). Marks `timeline` up to the KV landing."""
        handover = self.handover
        client = self._client(peer)
        ticket: asyncio.Future[bytes] | None = None
        call: asyncio.Future[PrefillReply] | None = None
        if handover.overlap_reserve:  # the call goes out first: the prompt is computed while we reserve
            ticket = asyncio.get_running_loop().create_future()
            call = asyncio.ensure_future(client.prefill(PrefillCall(rid, prompt, params, b""),
                                                        timeout_s=self.transfer_timeout, ticket=ticket))

        def reserve():
            return handover.reserve(rid, prompt, params, priority, min_remote_tokens=self.threshold,
                                    timeout_s=self.transfer_timeout)

        try:
            reservation = await reserve()
        except BaseException:
            settle(call)
            raise
        if reservation.refused == "no_free_blocks":  # wait for room; an early call computes meanwhile
            try:
                reservation = await reserve_when_room(reserve, self._free_blocks, self._blocks_for(prompt),
                                                      self.reserve_wait)
            except BaseException:  # NoRoom (busy), or the caller left
                settle(call)
                raise
        timeline.reserved = time.monotonic()
        if reservation.ticket is None:
            settle(call)  # the prefill worker stops computing it (its call ends without a ticket)
            LOCAL_PREFILL.labels(reservation.refused).inc()
            return None, False
        if ticket is not None:
            ticket.set_result(reservation.ticket)
        else:
            call = asyncio.ensure_future(client.prefill(PrefillCall(rid, prompt, params, reservation.ticket),
                                                        timeout_s=self.transfer_timeout))
        landed = asyncio.ensure_future(handover.landed(rid))
        timeline.sent = time.monotonic()
        try:
            try:
                reply = await call
                timeline.replied = time.monotonic()
                await landed
                timeline.landed = time.monotonic()
            finally:
                for task in (call, landed):  # the first error is the one reported
                    settle(task)
        except asyncio.CancelledError:  # the caller left: the reservation goes (once nothing can write it)
            handover.cancel(rid, call)
            raise
        except (TimeoutError, WorkerCallError, HandoverFailed) as e:
            handover.cancel(rid, call)  # its blocks are freed once the call ended and no write can land
            REMOTE_PREFILL.labels("failed").inc()
            LOCAL_PREFILL.labels("fallback").inc()
            if peer not in self._warned:
                log.warning("remote prefill on %s failed (%s); prefilling locally", peer,
                            e.details if isinstance(e, WorkerCallError) else e)
                self._warned.add(peer)
            return self._local_after_fallback(rid, prompt, params, priority), False
        self._warned.discard(peer)
        REMOTE_PREFILL.labels("ok").inc()
        lp = reply.first_logprob
        if handover.streams_first_token:  # a pull: the decode engine reads the KV and samples the first token
            try:
                return handover.admit(rid, reply.first_token_id, lp, reply.receipt), True
            except HandoverFailed as e:  # a receipt that does not validate
                LOCAL_PREFILL.labels("fallback").inc()
                log.warning("remote prefill on %s returned an unusable receipt (%s); prefilling locally", peer, e)
                return self._local_after_fallback(rid, prompt, params, priority), False
        first = RequestOutput(rid, [reply.first_token_id], [lp] if lp is not None else [],
                              num_prompt_tokens=len(prompt), num_cached_tokens=reservation.num_cached_tokens,
                              num_output_tokens=1)
        return self._first_then(first, handover.admit(rid, reply.first_token_id, lp)), True

    def _free_blocks(self) -> int:
        """KV blocks free as of the engine's last step (its published counters: never waits for a step)."""
        s = self.engine.stats()
        return s.get("kv_blocks_total", 0) - s.get("kv_blocks_used", 0)

    def _blocks_for(self, prompt: Sequence[int]) -> int:
        """Free blocks a reservation of `prompt` needs, by the published counts: the prompt's, and one for each
        running request to grow into (the engine's own rule; a prefix-cache hit needs fewer)."""
        bs = self.engine.facts.block_size
        return -(-len(prompt) // bs) + self.engine.stats().get("num_running", 0)

    async def _first_then(self, first: RequestOutput,
                          stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The first token as soon as its KV has landed, then the engine's stream from the request's admission
        on (its first output repeats that token, so it goes on without it, and only if it ends the request).
        The admission no longer delays the first token."""
        admitted = False
        try:
            yield first
            admitted = True
            repeat = True
            async for out in stream:
                if repeat:
                    repeat = False
                    out = dataclasses.replace(out, new_token_ids=[], new_logprobs=[])
                    if not out.finished:
                        continue
                yield out
        finally:
            if not admitted:  # the caller left after the first token: the reserved blocks go too
                self.handover.cancel(first.request_id)

    def _local_after_fallback(self, rid, prompt, params, priority) -> AsyncIterator[RequestOutput]:
        # a new engine id: the failed reservation keeps its blocks until the handover frees them
        local_id = f"{rid}#local"

        async def relabel() -> AsyncIterator[RequestOutput]:
            async for out in self.engine.generate(local_id, prompt, params, priority):
                out.request_id = rid
                yield out

        return relabel()

    def _chunk(self, out: RequestOutput, remote: bool, resumed: int) -> GenerateChunk:
        """Usage as the request sees it: the `resumed` tokens it produced elsewhere count as output, not prompt.
        A request that failed may move to another worker when the engine says so, or when it has stopped."""
        prompt_tokens = max(0, out.num_prompt_tokens - resumed)
        retry = out.retry if out.finish_reason == "error" else None
        if out.finished and out.finish_reason in ("error", "abort") and self.engine.dead:
            retry = RetryReason.ENGINE  # this worker can no longer run it; another one can
        return GenerateChunk(
            out.request_id, out.new_token_ids, out.new_logprobs, out.finished, out.finish_reason or "",
            "" if out.stop_reason is None else str(out.stop_reason), prompt_tokens,
            min(out.num_cached_tokens + out.num_loaded_tokens, prompt_tokens), out.num_output_tokens + resumed,
            out.error or "", remote, retry)

    async def close(self) -> None:
        await self._tasks.close()
        for resource in self.resources:
            await resource.close()
        for client in self._peers.values():
            await client.close()
        if self.handover is not None:
            await self.handover.close()
