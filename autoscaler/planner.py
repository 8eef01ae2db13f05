"""The slow loop's arithmetic: how many replicas each pool needs for the load it sees, and a forecast of that
need over the time a new replica takes to start.

Need is measured in replicas running flat out (`profile.capacity_at_slo`): for prefill, prompt tokens/s over
a replica's prefill tokens/s; for decode, output tokens/s over a replica's tokens/s at the largest batch the
ITL objective, the KV cache and max_num_seqs allow. 3.2 means the work of 3.2 busy replicas. The law divides
it by a target utilisation, which for prefill the TTFT objective may lower (queueing). The forecast is a
least-squares line through the last minutes of that need, read a cold start + planner period ahead, so
scale-up leads demand by the cold start. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.autoscaler.observations import Observation
from splitserve.autoscaler.profile import ReplicaCapacity, ReplicaProfile, capacity_at_slo


@dataclass(frozen=True)
class Needs:
    """Replicas each pool needs now (fractional, flat out), and why, for one observation."""

    prefill: float  # prompt tokens/s / a replica's prefill tokens/s
    decode: float  # output tokens/s / a replica's decode tokens/s at the SLO batch, plus local prefill time
    prefill_backlog_s: float  # s the ready prefill replicas need to clear their queue flat out
    capacity: ReplicaCapacity


def needs(obs: Observation, profile: ReplicaProfile, ttft_s: float, itl_s: float,
          decode_at_every_prompt: bool = False) -> Needs:
    """The need of both pools. Decode's batch is sized at the context of the prompts prefill receives (the long
    ones, a conservative batch), or with `decode_at_every_prompt` at the mean of every prompt decode serves (the
    batch it runs; the law asks for it while the load is smooth)."""
    p, d = obs.prefill, obs.decode
    mean_in = p.mean_input_tokens if p.arrival_rate > 0 else d.mean_input_tokens
    cap = capacity_at_slo(profile, ttft_s, itl_s, mean_in or 1.0, d.mean_output_tokens or 1.0, max_utilization=1.0)
    prefill = p.input_tokens_per_s / cap.prefill_raw_tokens_per_s
    dcap = cap
    if decode_at_every_prompt and d.mean_input_tokens > 0:
        dcap = capacity_at_slo(profile, ttft_s, itl_s, d.mean_input_tokens, d.mean_output_tokens or 1.0,
                               max_utilization=1.0)
    # decode workers also prefill short prompts themselves (below the disaggregation threshold)
    local = d.input_tokens_per_s / profile.prefill_tokens_per_s(d.mean_input_tokens or 1.0)
    decode = d.output_tokens_per_s / dcap.decode_tokens_per_s + local
    backlog = p.waiting_prefill_tokens / (max(1, p.replicas_ready) * cap.prefill_raw_tokens_per_s)
    return Needs(prefill, decode, backlog, cap)


def forecast(history: tuple[tuple[float, float], ...], now: float, horizon_s: float, min_span_s: float = 0.0,
             max_growth: float = float("inf")) -> float:
    """The need `horizon_s` after `now` on the least-squares line through `history` ((s, replicas) samples).

    A line over minutes, not a smoothed level and trend over seconds: one noisy window moves it little, and a
    rise that lasts is extrapolated across the cold start. Until the history spans `min_span_s` there is no
    line (a few windows of a ramp are no trend), and the line's rise is capped at `max_growth` x the line's
    value now (a ramp that stops must not leave the plan far above the load).
    """
    if not history:
        return 0.0
    if len(history) < 3 or history[-1][0] - history[0][0] < min_span_s:
        return history[-1][1]
    n = len(history)
    mt = sum(t for t, _ in history) / n
    mv = sum(v for _, v in history) / n
    var = sum((t - mt) ** 2 for t, _ in history)
    slope = sum((t - mt) * (v - mv) for t, v in history) / var if var > 0 else 0.0
    level = max(0.0, mv + slope * (now - mt))
    return max(0.0, min(mv + slope * (now + horizon_s - mt), level * (1 + max_growth)))
