"""The Prefill RPC: compute the prompt, put its KV where the decode worker's ticket says (the handover), and
return the first token.

The ticket is opaque here: the engine's prefill-side handover reads it, streams the KV and keeps the computed
blocks in this worker's prefix cache afterwards. `Prefill` brings the ticket with the request; `PrefillEarly`
brings the request first and the ticket once the decode worker has reserved its blocks, so the prompt's compute
starts while the decode worker reserves (the handover needs the ticket only to send). Each call that succeeds
leaves a timeline of its stages (`PrefillTimeline`), observed in `splitserve_prefill_stage_seconds{stage}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol.convert import ProtocolError, check_request, logprob_to_pb, params_from_pb
from splitserve.common.protocol.service import MalformedMessage
from splitserve.common.tasks import settle
from splitserve.common.worker_metrics import WORKER_REQUESTS
from splitserve.engine.interface import BadTicket, HandoverFailed, PrefillHandover, ServingEngine
from splitserve.prefill_worker.metrics import PrefillTimeline

log = logging.getLogger("splitserve.prefill_worker")


class PrefillService:
    role = "prefill"

    def __init__(self, engine: ServingEngine, handover: PrefillHandover) -> None:
        self.engine = engine
        self.handover = handover

    async def prefill(self, req: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        """The request with its ticket."""
        ticket: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        ticket.set_result(req.ticket)
        return await self._prefill(req, ticket, time.monotonic(), context)

    async def prefill_early(self, messages: AsyncIterator[pb.PrefillStreamMessage],
                            context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        """The request first, its ticket after it (the decode worker reserves its blocks meanwhile): the prompt is
        computed as soon as the request is here, and its KV sent once the ticket is."""
        received = time.monotonic()
        first = await anext(aiter(messages), None)
        if first is None or first.WhichOneof("body") != "request":
            WORKER_REQUESTS.labels("prefill", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PrefillEarly: the first message must be the request")
        ticket: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def read_ticket() -> None:
            try:
                msg = await anext(aiter(messages), None)
            except MalformedMessage as e:
                ticket.set_exception(BadTicket(str(e)))
                return
            except (grpc.RpcError, asyncio.CancelledError) as e:  # the call ended under us
                ticket.set_exception(HandoverFailed(f"the ticket never came: {e!r}"))
                return
            if msg is None or msg.WhichOneof("body") != "ticket":  # a caller that gives up cancels the call
                ticket.set_exception(BadTicket("PrefillEarly: the second message must be the ticket"))
            else:
                ticket.set_result(msg.ticket)

        reader = asyncio.ensure_future(read_ticket())
        try:
            return await self._prefill(first.request, ticket, received, context)
        finally:
            reader.cancel()
            settle(ticket)  # the call's outcome already says what failed

    async def _prefill(self, req: pb.PrefillRequest, ticket: asyncio.Future[bytes], received: float,
                       context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        timeline = PrefillTimeline(received)
        facts = self.engine.facts
        try:
            check_request(req.protocol_version, req.request_id, req.prompt_token_ids, facts.vocab_size,
                          facts.max_model_len)
            params = params_from_pb(req.params)
        except ProtocolError as e:
            WORKER_REQUESTS.labels("prefill", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # the prompt and its first token only, whatever the request asks of the decode worker
        first_params = dataclasses.replace(params, max_tokens=1, min_tokens=0, stop=[], ignore_eos=True)
        try:
            result = await self.handover.run(ticket, req.request_id, list(req.prompt_token_ids), first_params)
        except BadTicket as e:  # a ticket that does not fit: nothing was sent
            WORKER_REQUESTS.labels("prefill", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except HandoverFailed as e:  # the handover stopped writing into the ticket's blocks before raising
            WORKER_REQUESTS.labels("prefill", "transfer_error").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed: {e}")
        WORKER_REQUESTS.labels("prefill", "ok").inc()
        timeline.scheduled, timeline.computed, timeline.sent = result.scheduled, result.computed, result.sent
        timeline.observe_replied(time.monotonic())
        lp = result.first_logprob
        return pb.PrefillResponse(
            request_id=req.request_id, first_token_id=result.first_token_id, has_logprob=lp is not None,
            first_logprob=logprob_to_pb(lp) if lp is not None else None,
            cached_tokens=result.num_cached_tokens, kv_bytes=result.kv_bytes, receipt=result.receipt,
        )

    async def close(self) -> None:
        await self.handover.close()
