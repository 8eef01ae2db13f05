"""A decode worker's own metrics: where each prompt's KV came from, and how long each stage of a remote
prefill's handover took (the control path between a Generate call and its first decoded token)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from splitserve.common.stages import STAGE_BUCKETS, observe_stages

LOCAL_PREFILL = Counter("splitserve_local_prefill", "Prompts the decode worker prefilled itself", ["reason"])
REMOTE_PREFILL = Counter("splitserve_remote_prefill", "Prompts whose KV came from a prefill worker", ["outcome"])
# no_free_blocks: kept for dashboards; a decode worker now waits for room, or sends the request back (RESERVE_WAITS)
LOCAL_PREFILL_REASONS = ("short_prompt", "fallback", "no_prefill_worker", "no_free_blocks", "unknown_prefill_worker")
RESERVE_WAITS = Counter("splitserve_reserve_waits",
                        "Remote prefills whose KV reservation found no room at first: reserved after waiting for blocks "
                        "to free (reserved), or sent back to the gateway as busy after decode.reserveWaitSeconds (busy)",
                        ["outcome"])
RESERVE_WAIT_OUTCOMES = ("reserved", "busy")

HANDOVER_STAGE = Histogram(
    "splitserve_handover_stage_seconds",
    "Time a remotely prefilled request spent in each stage of its handover on the decode worker",
    ["stage"], buckets=STAGE_BUCKETS)
# in order: each stage ends at the mark named beside it
HANDOVER_STAGES = (
    "reserve",       # Generate received -> KV blocks reserved (and their ticket published: the handover's reserve)
    "ticket",        # -> ticket sent (on the prefill call already out; or with the call, which goes out then)
    "prefill",       # -> Prefill reply received (the prefill worker's whole time and the gRPC hop)
    "kv_wait",       # -> KV landed (the transfer's tail exposed after the reply; ~0 when it landed first)
    "first_token",   # -> first token sent on (as soon as the KV landed; the engine admits the request after)
    "first_decode",  # -> first decoded token out (the second output token; only requests that decode)
)


@dataclass
class HandoverTimeline:
    """One remote prefill's time.monotonic() marks on this worker (seconds). Stages are observed only for a
    handover that succeeded: one that fell back to local prefill is counted in LOCAL_PREFILL instead."""

    received: float
    reserved: float = 0.0
    sent: float = 0.0
    replied: float = 0.0
    landed: float = 0.0
    first_token: float = 0.0

    def observe_first_token(self, now: float) -> None:
        """The first token is out: observe every stage up to it."""
        self.first_token = now
        observe_stages(HANDOVER_STAGE, HANDOVER_STAGES[:-1],
                       (self.received, self.reserved, self.sent, self.replied, self.landed, now))

    def observe_first_decode(self, now: float) -> None:
        HANDOVER_STAGE.labels("first_decode").observe(now - self.first_token)
