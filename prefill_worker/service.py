"""The Prefill RPC: compute the prompt, stream its KV into the ticket's blocks, return the first token.

The computed blocks stay in this worker's prefix cache after the transfer (they are released, not dropped).
Each call that succeeds leaves a timeline of its stages (`PrefillTimeline`), observed in
`splitserve_prefill_stage_seconds{stage}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol.convert import ProtocolError, check_request, logprob_to_pb, params_from_pb
from splitserve.common.tasks import TaskOwner
from splitserve.common.worker_metrics import WORKER_REQUESTS
from splitserve.engine.interface import ServingEngine
from splitserve.engine.kv_cache_manager import cdiv
from splitserve.kv_transfer import (
    KVTransferAgent,
    MalformedTicket,
    SendSession,
    TransferError,
    TransferTicket,
)
from splitserve.kv_transfer.pool import KVPool
from splitserve.kv_transfer.stream_hook import KVStreamHook
from splitserve.prefill_worker.metrics import PrefillTimeline

log = logging.getLogger("splitserve.prefill_worker")


class PrefillService:
    role = "prefill"

    def __init__(self, engine: ServingEngine, agent: KVTransferAgent, hook: KVStreamHook,
                 pool: KVPool | None = None) -> None:
        self.engine = engine
        self.agent = agent
        self.hook = hook
        self.pool = pool  # prompts' blocks already in the KV pool are loaded, not computed
        self._tasks = TaskOwner("prefill")  # block releases queued behind replies

    async def prefill(self, req: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        timeline = PrefillTimeline(time.monotonic())
        facts = self.engine.facts
        try:
            check_request(req.protocol_version, req.request_id, req.prompt_token_ids, facts.vocab_size,
                          facts.max_model_len)
            params = params_from_pb(req.params)
            ticket = TransferTicket.decode(req.ticket)
            ticket.check_compatible(self.agent.layout)
            if ticket.request_id != req.request_id:
                raise ProtocolError("ticket.request_id differs from request_id")
            need = cdiv(len(req.prompt_token_ids), self.engine.kv_spec.block_size)
            if len(ticket.block_ids) != need:
                raise ProtocolError(f"ticket has {len(ticket.block_ids)} blocks, the prompt needs {need}")
        except (ProtocolError, MalformedTicket) as e:
            WORKER_REQUESTS.labels("prefill", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = req.request_id
        first_params = dataclasses.replace(params, max_tokens=1, min_tokens=0, stop=[], ignore_eos=True)
        prompt = list(req.prompt_token_ids)

        def begin(blocks: list[int]) -> SendSession:  # on the engine thread, at the request's first step
            timeline.scheduled = time.monotonic()
            return self.agent.begin(ticket, blocks)

        done = self.hook.register(rid, begin, len(prompt))
        sent = False
        try:
            first = None
            async for out in (self.pool or self.engine).generate(rid, prompt, first_params, hold_blocks=True):
                first = out
            if first is None or first.finish_reason in ("abort", "error") or not first.new_token_ids:
                raise TransferError(f"{rid}: prefill did not produce a token ({first and first.error})")
            await done.wait_async(max(0.5, ticket.deadline - time.time()))
            timeline.computed = time.monotonic()
            error = self.hook.error(rid)
            session = self.hook.session(rid)
            if error is not None or session is None:
                raise error or TransferError(f"{rid}: no KV stream was started")
            await asyncio.to_thread(session.finish)
            timeline.sent = time.monotonic()
            sent = True
        except TransferError as e:
            WORKER_REQUESTS.labels("prefill", "transfer_error").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed: {e}")
        finally:
            if not sent:  # failed or cancelled (the decode worker gave up): stop writing into its blocks
                session = self.hook.session(rid)
                if session is not None:
                    session.abort()
            self.hook.unregister(rid)
            if sent:  # the reply need not wait for the engine's step in progress: release behind it
                self._tasks.spawn(self.engine.release(rid), f"release {rid}")
            else:
                await self.engine.release(rid)
        WORKER_REQUESTS.labels("prefill", "ok").inc()
        timeline.observe_replied(time.monotonic())
        lp = first.new_logprobs[0] if first.new_logprobs else None
        return pb.PrefillResponse(
            request_id=rid, first_token_id=first.new_token_ids[0], has_logprob=lp is not None,
            first_logprob=logprob_to_pb(lp) if lp is not None else None,
            cached_tokens=first.num_cached_tokens, kv_bytes=session.bytes,
        )

    async def close(self) -> None:
        await self._tasks.close()
        if self.pool is not None:
            await self.pool.close()
        self.agent.close()
