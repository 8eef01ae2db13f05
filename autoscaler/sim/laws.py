"""The scaling laws the simulator runs, behind one small interface: ours (`SLOLaw`, the real `law.decide`),
a static P:D, and the anchors' laws as their documentation describes them.

- Ray Serve LLM: +1 replica (prefill and decode deployments alike) when p99 TTFT is over the objective; -1 only
  when a replica is idle. Upscale/downscale delays: the cluster's cooldowns.
- llm-d WVA (saturation analyzer, v0.x defaults): a replica is saturated at KV usage >= 0.8 or queue >= 5; +1 when
  the mean spare KV < 0.1 or the mean spare queue < 3; -1 when the load over one replica fewer still leaves that
  much spare. No P/D awareness: it scales the decode variant; prefill keeps its starting size.
- Dynamo planner, load mode: every 5 s, +1 when the estimated TTFT (prefill queue drain + the mean prompt's
  prefill) or ITL (a decode step with the queued requests running) misses the objective, -1 when one replica
  fewer would still be under 0.8 of it; it waits while replicas start, and its scale-down kills the requests
  in flight on the removed replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from splitserve.autoscaler.flips import RoleFlip
from splitserve.autoscaler.law import ControllerState, LawConfig, ScalingDecision, decide
from splitserve.autoscaler.observations import Observation
from splitserve.autoscaler.profile import ReplicaProfile


class ScalingLaw(Protocol):
    name: str
    interval_s: float  # s between decisions
    kills_on_scale_down: bool  # False: removed replicas drain first

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        """(prefill replicas, decode replicas, reason)."""
        ...


@runtime_checkable
class FlipPlanner(Protocol):
    """A law that plans its own role flips (the simulator asks it after `decide`; a law that does not gets the
    actuator's rule, `flips.flips_between` its targets)."""

    def last_flip(self) -> RoleFlip | None:
        """The flip the last decision asked for, its workers counted in the desired replicas."""
        ...


@dataclass
class SLOLaw:
    """splitserve's law (autoscaler/law.py), holding its state between calls."""

    config: LawConfig
    interval_s: float = 15.0
    name: str = "slo"
    kills_on_scale_down: bool = False
    state: ControllerState = field(default_factory=ControllerState)
    last: ScalingDecision | None = None

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        self.last = decide(obs, self.state, self.config)
        self.state = self.last.state
        return self.last.prefill.desired, self.last.decode.desired, self.last.reason

    def last_flip(self) -> RoleFlip | None:
        return self.last.flip if self.last is not None else None


@dataclass
class StaticLaw:
    prefill: int
    decode: int
    interval_s: float = 60.0
    name: str = "static"
    kills_on_scale_down: bool = False

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        return self.prefill, self.decode, "static"


@dataclass
class _Cooldowns:
    up_s: float
    down_s: float
    last_up: dict[str, float] = field(default_factory=lambda: {"prefill": -1e18, "decode": -1e18})
    last_change: dict[str, float] = field(default_factory=lambda: {"prefill": -1e18, "decode": -1e18})

    def step(self, role: str, current: int, delta: int, now: float, lo: int, hi: int) -> int:
        if delta > 0 and now - self.last_up[role] >= self.up_s and current < hi:
            self.last_up[role] = self.last_change[role] = now
            return current + 1
        if delta < 0 and now - self.last_change[role] >= self.down_s and current > lo:
            self.last_change[role] = now
            return current - 1
        return current


@dataclass
class RayLaw:
    ttft_s: float
    up_s: float
    down_s: float
    max_replicas: int = 64
    interval_s: float = 15.0
    name: str = "ray"
    kills_on_scale_down: bool = False
    cool: _Cooldowns | None = None

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        self.cool = self.cool or _Cooldowns(self.up_s, self.down_s)
        out, why = {}, []
        p99 = obs.decode.ttft.p99
        for role in ("prefill", "decode"):
            ro = obs.role(role)
            delta = 1 if p99 is not None and p99 > self.ttft_s else -1 if ro.idle_replicas > 0 else 0
            out[role] = self.cool.step(role, ro.replicas, delta, obs.time, 1, self.max_replicas)
            why.append(f"{role} {'+1' if delta > 0 else '-1' if delta < 0 else '0'}")
        return out["prefill"], out["decode"], f"ttft p99 {p99}: " + ", ".join(why)


@dataclass
class WVALaw:
    up_s: float
    down_s: float
    kv_threshold: float = 0.8
    queue_threshold: float = 5
    kv_spare_trigger: float = 0.1
    queue_spare_trigger: float = 3
    max_replicas: int = 64
    interval_s: float = 15.0
    name: str = "wva"
    kills_on_scale_down: bool = False
    cool: _Cooldowns | None = None

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        self.cool = self.cool or _Cooldowns(self.up_s, self.down_s)
        d = obs.decode
        n = max(1, d.replicas_ready)
        kv, queue = d.kv_usage, d.num_waiting / n

        def spare(replicas: int) -> tuple[float, float]:
            return self.kv_threshold - kv * n / replicas, self.queue_threshold - queue * n / replicas

        kv_spare, q_spare = spare(n)
        delta = 0
        if kv_spare < self.kv_spare_trigger or q_spare < self.queue_spare_trigger:
            delta = 1
        elif n > 1 and min(spare(n - 1)[0] - self.kv_spare_trigger, spare(n - 1)[1] - self.queue_spare_trigger) >= 0:
            delta = -1
        new_d = self.cool.step("decode", d.replicas, delta, obs.time, 1, self.max_replicas)
        return obs.prefill.replicas, new_d, f"decode spare kv {kv_spare:.2f} queue {q_spare:.1f}: {delta:+d}"


@dataclass
class DynamoLoadLaw:
    profile: ReplicaProfile
    ttft_s: float
    itl_s: float
    down_fraction: float = 0.8
    max_replicas: int = 64
    interval_s: float = 5.0
    name: str = "dynamo"
    kills_on_scale_down: bool = True

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        p, d = obs.prefill, obs.decode
        out = {"prefill": p.replicas, "decode": d.replicas}
        if p.replicas_starting or d.replicas_starting:  # it waits while workers are being added
            return out["prefill"], out["decode"], "waiting for new workers"
        prof = self.profile
        mean_in = max(1.0, p.mean_input_tokens or d.mean_input_tokens)
        raw = prof.prefill_tokens_per_s(mean_in)
        service = prof.prefill_seconds(round(mean_in))

        def ttft(n: int) -> float:
            return p.waiting_prefill_tokens / (max(1, n) * raw) + service

        ctx = d.mean_input_tokens + d.mean_output_tokens / 2

        def itl(n: int) -> float:
            batch = max(1, round((d.num_running + d.num_waiting) / max(1, n)))
            return prof.cost.decode_seconds(batch, int(batch * ctx))

        for role, est, slo, ro in (("prefill", ttft, self.ttft_s, p), ("decode", itl, self.itl_s, d)):
            n = max(1, ro.replicas_ready)
            if est(n) > slo and ro.replicas < self.max_replicas:
                out[role] = ro.replicas + 1
            elif n > 1 and est(n - 1) < self.down_fraction * slo:
                out[role] = ro.replicas - 1
        return out["prefill"], out["decode"], f"est ttft {ttft(p.replicas_ready):.2f} s itl {itl(d.replicas_ready) * 1e3:.0f} ms"


@dataclass
class LateOracleLaw:
    """A reference, not a law: each oracle window it holds the largest of the oracle's plans for the `span`
    windows before it (the first window: the oracle's own first plan, where every law starts). It knows exactly
    what every past window needed, with the oracle's hindsight, and acts on it one window late: what a reactive
    law could do at best by reading the past better. Scale-ups load for the cold start like any law's."""

    plans: list[tuple[int, int]]  # the oracle's (prefill, decode) per window
    window_s: float
    span: int = 1  # windows looked back over (len(plans): every window so far)
    interval_s: float = 15.0
    name: str = "late_oracle"
    kills_on_scale_down: bool = False

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        k = min(int(obs.time // self.window_s), len(self.plans))
        past = self.plans[max(0, k - self.span):k] or self.plans[:1]
        p, d = max(x[0] for x in past), max(x[1] for x in past)
        return max(1, p), max(1, d), f"the oracle's largest plan of the {len(past)} windows before window {k}"


@dataclass
class ForesightLaw:
    """A reference, not a law: it follows a plan per window that its caller computed (with whatever knowledge of
    the future the caller grants), plus a standing `margin` of (prefill, decode) replicas: the largest plan of
    the windows from now to a cold start (`lead_s`) ahead, so a window's replicas are ready when it begins and
    kept until a window that needs fewer begins."""

    plans: list[tuple[int, int]]  # (prefill, decode) per window, from time 0
    window_s: float
    lead_s: float
    margin: tuple[int, int] = (0, 0)
    interval_s: float = 15.0
    name: str = "foresight"
    kills_on_scale_down: bool = False
    # with role flips: the total follows `plans` (known `lead_s` ahead), the split these (known `split_lead_s`
    # ahead, a flip's time), which the actuator reaches by flips
    split_plans: list[tuple[int, int]] | None = None
    split_lead_s: float = 0.0

    def _span(self, plans: list[tuple[int, int]], time: float, lead_s: float) -> list[tuple[int, int]]:
        last = len(plans) - 1
        return plans[min(int(time // self.window_s), last):min(int((time + lead_s) // self.window_s), last) + 1]

    def at(self, time: float) -> tuple[int, int]:
        """The (prefill, decode) it holds at `time` (at 0: where its run starts, ready)."""
        span = self._span(self.plans, time, self.lead_s)
        p, d = max(x[0] for x in span) + self.margin[0], max(x[1] for x in span) + self.margin[1]
        if self.split_plans is None:
            return max(1, p), max(1, d)
        # flips: the cold start bounds the total only (the largest window's, not each role's largest), and
        # within it each role gets what the windows a flip ahead need with its margin; what is left goes where
        # the total's own plans put it
        total = max(2, max(x[0] + x[1] for x in span) + sum(self.margin))
        near = self._span(self.split_plans, time, self.split_lead_s)
        want_p = max(1, max(x[0] for x in near) + self.margin[0])
        want_d = max(1, max(x[1] for x in near) + self.margin[1])
        if want_p + want_d <= total:
            sp = want_p + min(total - want_p - want_d, max(0, p - want_p))
        else:
            sp = round(total * want_p / (want_p + want_d))
        sp = min(max(1, sp), total - 1)
        return sp, total - sp

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        split = "" if self.split_plans is None else f", split by the plans of the next {self.split_lead_s:.0f} s"
        return *self.at(obs.time), f"the largest plan of the next {self.lead_s:.0f} s, margin {self.margin}{split}"
