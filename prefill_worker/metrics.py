"""A prefill worker's own metrics: how long each stage of a Prefill call took, from the request's arrival to
the reply (the prefill worker's share of a disaggregated handover)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Histogram

from splitserve.common.stages import STAGE_BUCKETS, observe_stages

PREFILL_STAGE = Histogram(
    "splitserve_prefill_stage_seconds",
    "Time a Prefill call that succeeded spent in each stage on the prefill worker",
    ["stage"], buckets=STAGE_BUCKETS)
# in order: each stage ends at the mark named beside it
PREFILL_STAGES = (
    "queue",      # Prefill received -> first scheduled in an engine step (its KV stream starts)
    "compute",    # -> last chunk computed, every layer's KV queued to send, first token back on the service
    "kv_finish",  # -> the KV sender finished (every write landed and the receiver was told)
    "reply",      # -> reply ready (the blocks' release to the prefix cache is queued behind it)
)


@dataclass
class PrefillTimeline:
    """One Prefill call's time.monotonic() marks (seconds), the handover's (`PrefillResult`) among them."""

    received: float
    scheduled: float = 0.0
    computed: float = 0.0
    sent: float = 0.0

    def observe_replied(self, now: float) -> None:
        observe_stages(PREFILL_STAGE, PREFILL_STAGES, (self.received, self.scheduled, self.computed, self.sent, now))
