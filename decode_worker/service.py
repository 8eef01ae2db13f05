"""The Generate RPC on a decode worker: reserve KV blocks for the uncached part of the prompt, have the named
prefill worker compute it and stream its KV in, then decode from the first token it returns.

Short prompts (or no prefill worker) are prefilled locally. If the prefill worker fails, stalls past the
transfer deadline or dies, the request is prefilled locally instead and still succeeds. Reserved blocks a
failed transfer may still write into are freed only after the prefill call has ended (deferred free).

Each remote prefill that succeeds leaves a timeline of its handover (`HandoverTimeline`): a time.monotonic()
mark at the end of each stage, observed in `splitserve_handover_stage_seconds{stage}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from splitserve.common.membership import Membership
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.convert import (
    ProtocolError,
    check_request,
    logprob_from_pb,
    logprob_to_pb,
    params_from_pb,
    params_to_pb,
)
from splitserve.common.tasks import TaskOwner
from splitserve.common.worker_metrics import PREFIX_HIT_TOKENS, PROMPT_TOKENS, WORKER_REQUESTS
from splitserve.decode_worker.metrics import LOCAL_PREFILL, REMOTE_PREFILL, HandoverTimeline
from splitserve.engine.interface import ServingEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.kv_transfer import KVTransferAgent, TransferError
from splitserve.kv_transfer.pool import KVPool

log = logging.getLogger("splitserve.decode_worker")


class RemotePrefillFailed(Exception):
    pass


class DecodeService:
    """Generate on a decode worker (`agent` and prefill peers) or a colocated one (no agent: always local)."""

    def __init__(self, engine: ServingEngine, agent: KVTransferAgent | None, membership: Membership,
                 threshold: int = 512, transfer_timeout: float = 30.0, pool: KVPool | None = None) -> None:
        self.role = "decode" if agent is not None else "both"
        self.engine = engine
        self.agent = agent
        self.membership = membership
        self.threshold = threshold
        self.transfer_timeout = transfer_timeout
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.WorkerStub]] = {}  # endpoint -> channel, stub
        self._warned: set[str] = set()
        self._tasks = TaskOwner("decode")
        self.pool = pool  # prompts prefilled here load their blocks from the KV pool where that pays
        self._local = pool or engine

    def _peer(self, name: str) -> str | None:
        """The endpoint of prefill peer `name`, if membership has it (a name from the router, never an address)."""
        for w in self.membership.workers():
            if w.name == name and w.role == "prefill" and not w.draining:
                return w.endpoint
        return None

    def _stub(self, endpoint: str) -> pb_grpc.WorkerStub:
        entry = self._stubs.get(endpoint)
        if entry is None:
            channel = grpc.aio.insecure_channel(endpoint)
            entry = self._stubs[endpoint] = (channel, pb_grpc.WorkerStub(channel))
        return entry[1]

    def _has_peers(self) -> bool:
        return self.agent is not None and any(w.role == "prefill" for w in self.membership.workers())

    async def generate(self, req: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        received = time.monotonic()
        facts = self.engine.facts
        peer = None
        try:
            check_request(req.protocol_version, req.request_id, req.prompt_token_ids, facts.vocab_size,
                          facts.max_model_len)
            params = params_from_pb(req.params)
            if req.prefill_worker and self.agent is not None:
                peer = self._peer(req.prefill_worker)
                if peer is None:  # not (or not yet, or no longer) a peer: never an address from a client
                    LOCAL_PREFILL.labels("unknown_prefill_worker").inc()
        except ProtocolError as e:
            WORKER_REQUESTS.labels("generate", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(req.prompt_token_ids)
        rid = req.request_id
        stream: AsyncIterator[RequestOutput] | None = None
        remote = False
        timeline: HandoverTimeline | None = None  # a remote prefill that succeeded, until its first decode
        if peer is not None and len(prompt) >= self.threshold:
            timeline = HandoverTimeline(received)
            stream, remote = await self._remote(rid, prompt, params, req.priority, peer, timeline)
            if not remote:
                timeline = None
        elif peer is not None or (self._has_peers() and not req.prefill_worker):
            LOCAL_PREFILL.labels("short_prompt" if peer is not None else "no_prefill_worker").inc()
        if stream is None:
            stream = self._local.generate(rid, prompt, params, req.priority)
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
            yield _to_pb(out, remote)

    async def _remote(self, rid, prompt, params, priority, peer,
                      timeline: HandoverTimeline) -> tuple[AsyncIterator[RequestOutput] | None, bool]:
        """Remote prefill: (its stream, True); (the local fallback's stream, False) when the transfer failed;
        (None, False) means prefill locally (the reason is counted). Marks `timeline` up to the KV landing."""
        reserved = await self.engine.reserve_remote(rid, prompt, params, priority)
        timeline.reserved = time.monotonic()
        if reserved is None:
            LOCAL_PREFILL.labels("no_free_blocks").inc()
            return None, False
        block_ids, cached = reserved
        bs = self.engine.kv_spec.block_size
        if len(prompt) - cached < self.threshold:
            await self.engine.abort(rid)
            LOCAL_PREFILL.labels("short_prompt").inc()
            return None, False
        ticket = self.agent.expect(rid, block_ids, skip_blocks=cached // bs, timeout_s=self.transfer_timeout)
        call = self._stub(peer).Prefill(pb.PrefillRequest(
            protocol_version=PROTOCOL_VERSION, request_id=rid, prompt_token_ids=prompt,
            params=params_to_pb(params), ticket=ticket.encode()), timeout=self.transfer_timeout)
        landed = asyncio.ensure_future(self.agent.wait(rid))
        timeline.sent = time.monotonic()
        try:
            try:
                resp = await call
                timeline.replied = time.monotonic()
                await landed
                timeline.landed = time.monotonic()
            finally:
                if not landed.done():
                    landed.cancel()
                elif not landed.cancelled():
                    landed.exception()  # observed here: the call's error is the one reported
        except (TimeoutError, grpc.aio.AioRpcError, TransferError) as e:
            self.agent.cancel(rid)
            self.agent.forget(rid)
            self._tasks.spawn(self._free_after(rid, call), f"free {rid}")
            REMOTE_PREFILL.labels("failed").inc()
            LOCAL_PREFILL.labels("fallback").inc()
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            if peer not in self._warned:
                log.warning("remote prefill on %s failed (%s); prefilling locally", peer, reason)
                self._warned.add(peer)
            return self._local_after_fallback(rid, prompt, params, priority), False
        self.agent.forget(rid)
        self._warned.discard(peer)
        REMOTE_PREFILL.labels("ok").inc()
        lp = logprob_from_pb(resp.first_logprob) if resp.has_logprob else None
        first = RequestOutput(rid, [resp.first_token_id], [lp] if lp is not None else [],
                              num_prompt_tokens=len(prompt), num_cached_tokens=cached, num_output_tokens=1)
        return self._first_then(first, self.engine.stream_remote(rid, resp.first_token_id, lp)), True

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
                self._tasks.spawn(self.engine.abort(first.request_id), f"abort {first.request_id}")

    async def _free_after(self, rid: str, call) -> None:
        """Free a failed reservation once the prefill call is over (a late write can no longer land)."""
        call.cancel()
        with contextlib.suppress(BaseException):  # any ending will do: the call is over
            await asyncio.wait_for(call, timeout=self.transfer_timeout)
        await asyncio.sleep(0.5)
        await self.engine.abort(rid)

    def _local_after_fallback(self, rid, prompt, params, priority) -> AsyncIterator[RequestOutput]:
        # a new engine id: the failed reservation keeps its blocks until _free_after releases them
        local_id = f"{rid}#local"

        async def relabel() -> AsyncIterator[RequestOutput]:
            async for out in self._local.generate(local_id, prompt, params, priority):
                out.request_id = rid
                yield out

        return relabel()

    async def close(self) -> None:
        await self._tasks.close()
        if self.pool is not None:
            await self.pool.close()
        for channel, _ in self._stubs.values():
            await channel.close()
        if self.agent is not None:
            self.agent.close()


def _to_pb(out: RequestOutput, remote: bool) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids,
        logprobs=[logprob_to_pb(lp) for lp in out.new_logprobs], finished=out.finished,
        finish_reason=out.finish_reason or "", stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens + out.num_loaded_tokens,
        completion_tokens=out.num_output_tokens, error=out.error or "", remote_prefill=remote,
    )
