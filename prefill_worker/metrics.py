"""A prefill worker's own metrics: how long each stage of a Prefill call took, from the request's arrival to
the reply (the prefill worker's share of a disaggregated handover)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Histogram

# seconds; from 0.1 ms: the stages around the compute are well under a millisecond on an idle worker
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                 2.5, 5, 10, 30)
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
    """One Prefill call's time.monotonic() marks (seconds); `scheduled` is set on the engine thread."""

    received: float
    scheduled: float = 0.0
    computed: float = 0.0
    sent: float = 0.0

    def observe_replied(self, now: float) -> None:
        marks = (self.received, self.scheduled, self.computed, self.sent, now)
        for stage, start, end in zip(PREFILL_STAGES, marks[:-1], marks[1:], strict=True):
            PREFILL_STAGE.labels(stage).observe(end - start)
