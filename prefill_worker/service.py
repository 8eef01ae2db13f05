"""The Prefill RPC: compute the prompt, put its KV where the decode worker's ticket says (the handover), and
return the first token.

The ticket is opaque here: the engine's prefill-side handover reads it, streams the KV and keeps the computed
blocks in this worker's prefix cache afterwards. Each call that succeeds leaves a timeline of its stages
(`PrefillTimeline`), observed in `splitserve_prefill_stage_seconds{stage}`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol.convert import ProtocolError, check_request, logprob_to_pb, params_from_pb
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
        timeline = PrefillTimeline(time.monotonic())
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
            result = await self.handover.run(req.ticket, req.request_id, list(req.prompt_token_ids), first_params)
        except BadTicket as e:  # refused before anything ran
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
