"""Prefill on a prefill worker: compute the prompt, put its KV where the decode worker's ticket says (the
handover), and return the first token.

The ticket is opaque here: the engine's prefill-side handover reads it, streams the KV and keeps the computed
blocks in this worker's prefix cache afterwards. `prefill` brings the ticket with the request; `prefill_early`
brings the request first and the ticket once the decode worker has reserved its blocks, so the prompt's compute
starts while the decode worker reserves (the handover needs the ticket only to send). Each call that succeeds
leaves a timeline of its stages (`PrefillTimeline`), observed in `splitserve_prefill_stage_seconds{stage}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable

from splitserve.common.worker_messages import (
    InvalidRequest,
    PrefillCall,
    PrefillReply,
    TransferFailed,
    check_prompt,
)
from splitserve.common.worker_metrics import WORKER_REQUESTS
from splitserve.engine.interface import BadTicket, HandoverFailed, PrefillHandover, ServingEngine
from splitserve.prefill_worker.metrics import PrefillTimeline

log = logging.getLogger("splitserve.prefill_worker")


class PrefillService:
    role = "prefill"

    def __init__(self, engine: ServingEngine, handover: PrefillHandover) -> None:
        self.engine = engine
        self.handover = handover

    async def prefill(self, call: PrefillCall) -> PrefillReply:
        """The request with its ticket."""
        ticket: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        ticket.set_result(call.ticket)
        return await self._prefill(call, ticket, time.monotonic())

    async def prefill_early(self, call: PrefillCall, ticket: Awaitable[bytes]) -> PrefillReply:
        """The request first, its ticket after it (the decode worker reserves its blocks meanwhile): the prompt is
        computed as soon as the request is here, and its KV sent once the ticket is. `ticket` raises
        `InvalidRequest` for what is not a ticket, `TransferFailed` when none came."""
        return await self._prefill(call, ticket, time.monotonic())

    async def _prefill(self, call: PrefillCall, ticket: Awaitable[bytes], received: float) -> PrefillReply:
        """Raises `InvalidRequest` (nothing was sent) or `TransferFailed`."""
        timeline = PrefillTimeline(received)
        facts = self.engine.facts
        try:
            check_prompt(call.prompt_token_ids, (), facts.vocab_size, facts.max_model_len)
        except InvalidRequest:
            WORKER_REQUESTS.labels("prefill", "invalid").inc()
            raise
        # the prompt and its first token only, whatever the request asks of the decode worker
        first_params = dataclasses.replace(call.params, max_tokens=1, min_tokens=0, stop=[], ignore_eos=True)
        try:
            result = await self.handover.run(ticket, call.request_id, list(call.prompt_token_ids), first_params)
        except (BadTicket, InvalidRequest) as e:  # a ticket that does not fit, or is none: nothing was sent
            WORKER_REQUESTS.labels("prefill", "invalid").inc()
            raise InvalidRequest(str(e)) from None
        except (HandoverFailed, TransferFailed) as e:  # the handover stopped writing into the ticket's blocks
            WORKER_REQUESTS.labels("prefill", "transfer_error").inc()
            raise TransferFailed(f"kv transfer failed: {e}") from None
        WORKER_REQUESTS.labels("prefill", "ok").inc()
        timeline.scheduled, timeline.computed, timeline.sent = result.scheduled, result.computed, result.sent
        timeline.observe_replied(time.monotonic())
        return PrefillReply(result.first_token_id, result.first_logprob, result.num_cached_tokens, result.kv_bytes,
                            result.receipt)

    async def close(self) -> None:
        await self.handover.close()
