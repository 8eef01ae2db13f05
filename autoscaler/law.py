"""The control law: `decide(observation, state, config)` -> a `ScalingDecision`: desired prefill and decode
replicas, the role flips that reach them first, a reason and the next state. A pure function (no clock, no I/O)
that the operator, `splitserve up --autoscale`, the Ray application and the simulator apply; docs/autoscaling.md
describes its loops, its memories and why each is there.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from splitserve.autoscaler.bounds import Bounds, clamp
from splitserve.autoscaler.flips import RoleFlip, flip_seconds, other
from splitserve.autoscaler.law_state import ROLES, ControllerState, RoleState
from splitserve.autoscaler.observations import Observation, Percentiles, RoleObservation
from splitserve.autoscaler.planner import Needs, forecast, needs
from splitserve.autoscaler.profile import (
    KV_HEADROOM,
    TTFT_TAIL,
    ReplicaProfile,
    capacity_at_slo,
    kv_sequences,
)
from splitserve.common.config import ClusterSpec

SMOOTH_BIN_S = 15.0  # s: the prompt load's smoothness is judged on its means over bins this long
SMOOTH_MIN_BINS = 8  # bins seen before a load can be called smooth (two minutes at the default interval)
# prefill's window while smooth is also at least this many cold starts: with 120 s starts, 180 s cost Mooncake
# 5 points of attainment (0.902 against 0.951 at 300 s)
SMOOTH_HOLD_COLD_STARTS = 3.0
# while smooth, decode's spare compute may carry at most this share of prefill's planned need (the prompts the
# router spills to decode workers); more cost attainment and GPU-seconds (decode scaled up for the spills)
SPILL_SHARE_MAX = 0.5
# a decode pool KV bounds plans for the largest need of the trend window and this much more (see `_role`)
KV_PEAK_MARGIN = 1.2
# decode replicas ready before, on such a load, decode's SLO loop reads its tail as spill noise (see `_slack`)
SPILL_TAIL_MIN_DECODE = 3
# one scale-down releases at most this share of a role's replicas (see `_step_down`)
SCALE_DOWN_STEP = 0.5
# bursts held (`_level`): each role holds this quantile of its need over the level window, a higher one while
# the window is filling (see `_level`)
LEVEL_WINDOW_S = 900.0
LEVEL_QUANTILE = 0.6

__all__ = ["ROLES", "ControllerState", "LawConfig", "RoleDecision", "RoleState", "ScalingDecision", "SmoothRegime",
           "decide"]


@dataclass(frozen=True)
class SmoothRegime:
    """What the law changes while the prompt load is smooth (`_smooth`: Azure conversation, Mooncake): it aims a
    little lower and lets replicas go sooner, waits longer between scale-ups, fits its trend and its need over
    less history, forecasts less growth, calls fewer queues a burst, lowers its utilisation ceiling and
    stretches its stabilisation window less. The operator's settings (target utilisation, cooldowns) move by a
    factor; the law's own are bounds, which a config already past keeps. Found by a random search over the
    law's parameters (benchmarks/autoscaling_search.py), then checked on three seeds of every trace (issue 40's
    sixth pass, docs/autoscaling.md). Loads that are not smooth (Azure code, the bursty trace) never see it."""

    utilization_shift: float = -0.048  # added to the target utilisation and its band (0.8 -> 0.752)
    scale_up_factor: float = 2.0  # the scale-up cooldown x this (30 s -> 60 s)
    scale_down_factor: float = 2 / 3  # both roles' scale-down cooldown x this (300 s -> 200 s)
    trend_window_s: float = 150.0  # at most
    max_forecast_growth: float = 0.1  # at most
    smoothing_s: float = 30.0  # at most
    burst_queue_fraction: float = 0.75  # at least: a queue must drain slower to count as a burst
    min_slo_factor: float = 0.85  # at least: SLO misses lower the target less
    max_utilization: float = 0.9  # at most
    max_hold_factor: float = 2.0  # at most
    smooth_prefill_hold_s: float = 300.0  # at least
    correction_gain: float = 0.1  # at most

    def apply(self, c: LawConfig) -> LawConfig:
        shift = max(self.utilization_shift, -c.low_utilization / 2)  # the band stays above 0
        return replace(
            c, target_utilization=c.target_utilization + shift, high_utilization=c.high_utilization + shift,
            low_utilization=c.low_utilization + shift, scale_up_cooldown_s=c.scale_up_cooldown_s * self.scale_up_factor,
            scale_down_cooldown_s=c.scale_down_cooldown_s * self.scale_down_factor,
            trend_window_s=min(c.trend_window_s, self.trend_window_s),
            max_forecast_growth=min(c.max_forecast_growth, self.max_forecast_growth),
            smoothing_s=min(c.smoothing_s, self.smoothing_s),
            burst_queue_fraction=max(c.burst_queue_fraction, self.burst_queue_fraction),
            min_slo_factor=max(c.min_slo_factor, self.min_slo_factor),
            max_utilization=min(c.max_utilization, self.max_utilization),
            max_hold_factor=min(c.max_hold_factor, self.max_hold_factor),
            smooth_prefill_hold_s=max(c.smooth_prefill_hold_s, self.smooth_prefill_hold_s),
            correction_gain=min(c.correction_gain, self.correction_gain))


@dataclass(frozen=True)
class LawConfig:
    """The law's parameters: the cluster's config (SLOs, cooldowns, bounds) and the replica profile."""

    profile: ReplicaProfile  # step costs and KV capacity of one replica (capacity at the SLO comes from it)
    bounds: Bounds = field(default_factory=Bounds)
    spills: bool = True  # the router sends prompts a backed-up prefill pool would queue to decode workers
    ttft_s: float = 2.0  # TTFT objective (p90)
    itl_s: float = 0.1  # ITL objective (p90)
    scale_up_cooldown_s: float = 30.0  # least time between two scale-ups of a role
    scale_down_cooldown_s: float = 300.0  # least time after a role's last change before it scales down
    planner_interval_s: float = 60.0  # the slow loop's period
    cold_start_s: float = 60.0  # s from asking for a replica to its first request: the forecast's lead
    flips: bool = False  # workers can move between the roles (`flips.RoleFlip`); False: starts and stops only
    flip_s: float = 5.0  # s a drained worker takes to serve the other role
    warm_replicas: int = 0  # replicas per role kept above the planned need
    warm_prefill: int | None = None  # prefill's, instead of warm_replicas (None: warm_replicas)
    warm_decode: int | None = None  # decode's, likewise
    hold_bursts: bool = False  # while the prompt load is not smooth, hold each role's level (`_level`)
    target_utilization: float = 0.8  # of a replica flat out, where a change lands (prefill: or lower, for TTFT)
    high_utilization: float = 0.9  # above this (forecast), scale up (scaled with the target for prefill)
    low_utilization: float = 0.6  # below this (forecast and now), scale down (likewise)
    burst_queue_fraction: float = 0.5  # a prefill queue draining slower than this x TTFT objective is a burst
    kv_high: float = 0.9  # decode KV usage above which waiting requests mean decode is short
    trend_window_s: float = 300.0  # the forecast's line fits the need over this much history (at least half)
    max_forecast_growth: float = 0.15  # the forecast rises at most this fraction above the line's value now
    smoothing_s: float = 60.0  # the need now is its mean over this much history
    correction_gain: float = 0.2  # per observation, how fast the prefill cost correction follows measurements
    min_slo_factor: float = 0.7  # SLO misses may lower a role's utilisation target down to this fraction of it
    max_utilization: float = 0.95  # slack under the objectives may raise a role's utilisation target up to this
    decode_compute_utilization: float | None = 1.1  # decode's ceiling instead while KV does not bound its batch
    max_hold_factor: float = 4.0  # regret may stretch the stabilisation window up to this x the cooldown
    prefill_scale_down_s: float | None = None  # prefill's cooldown and base window (None: the scale-down cooldown)
    burst_memory_s: float | None = None  # half-life of a burst's peak kept (None: 2 x scale-down cooldown; 0: none)
    smooth_window_s: float = 600.0  # the prompt load's smoothness is judged over this much history
    smooth_cv: float = 0.6  # smooth: prompt tokens per SMOOTH_BIN_S vary less than this (coefficient of variation)
    smooth_prefill_hold_s: float = 180.0  # prefill's cooldown and base window while smooth (or 3 cold starts)
    floor_memory_s: float | None = None  # half-life of decode's learned floor (None: 6 x scale-down cooldown; 0: none)
    smooth_regime: SmoothRegime | None = field(default_factory=SmoothRegime)  # while smooth (None: as otherwise)

    def __post_init__(self) -> None:
        if not 0 < self.low_utilization < self.target_utilization < self.high_utilization <= 1.0:
            raise ValueError("utilization: need 0 < low_utilization < target_utilization < high_utilization <= 1")

    @classmethod
    def from_spec(cls, spec: ClusterSpec, profile: ReplicaProfile, **overrides: Any) -> LawConfig:
        """The law for a SplitServeCluster spec (what the operator and `splitserve up --autoscale` run)."""
        a = spec.autoscaling
        bounds = Bounds.from_spec(spec)
        target = a.target_utilization
        values: dict[str, Any] = dict(
            profile=profile, bounds=bounds, ttft_s=spec.slo.ttft_seconds, itl_s=spec.slo.itl_seconds,
            scale_up_cooldown_s=a.scale_up_cooldown_seconds, scale_down_cooldown_s=a.scale_down_cooldown_seconds,
            planner_interval_s=a.planner_interval_seconds,
            # a trough as long as the cooldown releases replicas: the need's mean may not outlast it
            smoothing_s=min(cls.smoothing_s, max(a.scale_down_cooldown_seconds, a.interval_seconds)),
            cold_start_s=a.cold_start_seconds or profile.cold_start(spec.engine_of("decode")),
            flips=a.role_flips and spec.mode == "disaggregated",
            flip_s=profile.flip_seconds if a.flip_seconds is None else a.flip_seconds,
            warm_replicas=a.warm_replicas, warm_prefill=a.warm_prefill_replicas, warm_decode=a.warm_decode_replicas,
            hold_bursts=a.bursts == "hold", target_utilization=target,
            high_utilization=min(1.0, target + 0.1), low_utilization=max(0.05, target - 0.2),
            spills=spec.router.spill.prefill_backlog_tokens > 0)
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int  # replicas ready + starting when the law looked
    desired: int  # after the bounds
    action: str  # up | down | hold
    reason: str
    need: float  # replicas this window's load keeps busy (flat out)
    planned: float  # the planner's need: forecast a cold start ahead, smoothed
    utilization: float  # the target utilisation the desired count was sized at


@dataclass(frozen=True)
class ScalingDecision:
    """What every actuator applies: desired replicas per role, with the reason and the next state."""

    time: float
    prefill: RoleDecision
    decode: RoleDecision
    clamps: tuple[str, ...]  # the bounds that moved the loops' targets
    state: ControllerState
    flip: RoleFlip | None = None  # workers moved between the roles first (counted in `prefill`/`decode`)

    @property
    def replicas(self) -> dict[str, int]:
        return {"prefill": self.prefill.desired, "decode": self.decode.desired}

    @property
    def changed(self) -> bool:
        return self.prefill.desired != self.prefill.current or self.decode.desired != self.decode.current

    @property
    def reason(self) -> str:
        text = f"prefill {self.prefill.reason}; decode {self.decode.reason}"
        text += f"; flip {self.flip.workers} {self.flip.source}->{self.flip.target}: {self.flip.reason}" if self.flip else ""
        return text + (f"; clamped by {', '.join(self.clamps)}" if self.clamps else "")

    def as_status(self) -> dict[str, Any]:
        """JSON for the custom resource's status, the exported metrics and the local launcher's log."""
        return {"time": self.time, "reason": self.reason, "clamps": list(self.clamps),
                "flip": self.flip.as_status() if self.flip else None,
                **{r.role: {"current": r.current, "desired": r.desired, "action": r.action, "reason": r.reason,
                            "need": round(r.need, 3), "planned": round(r.planned, 3),
                            "utilization": round(r.utilization, 3)}
                   for r in (self.prefill, self.decode)}}


@dataclass(frozen=True)
class _Plan:
    """One role's wish before the bounds."""

    target: int
    reason: str
    state: RoleState
    need: float
    planned: float
    utilization: float
    burst: bool = False  # the fast loop saw pressure on this role now
    keep: int = 0  # the fewest replicas that carry the role's need without a scale-up (what a flip may leave)


def decide(obs: Observation, state: ControllerState, config: LawConfig) -> ScalingDecision:
    """One decision from one observation. Deterministic: same inputs, same decision."""
    load = tuple(x for x in state.load if obs.time - x[0] < config.smooth_window_s) + (
        (obs.time, obs.prefill.input_tokens_per_s + obs.decode.input_tokens_per_s),)
    smooth = _smooth(load, config)
    n = needs(obs, config.profile, config.ttft_s, config.itl_s, decode_at_every_prompt=smooth)
    if smooth and config.smooth_regime is not None:
        config = config.smooth_regime.apply(config)
    if smooth:
        hold = max(config.smooth_prefill_hold_s, SMOOTH_HOLD_COLD_STARTS * config.cold_start_s)
        config = replace(config, prefill_scale_down_s=min(_base_hold("prefill", config), hold))
    # on a smooth load whose spills decode can take, a queue or a busy window is noise that the spills and the
    # SLO loop absorb: no burst memory, no busiest-window hold, and decode's spare compute counts for prefill
    shared = smooth and _decode_takes_spills(obs.decode, config)
    if shared:
        config = replace(config, burst_memory_s=0.0)
    plans = {"decode": _role("decode", obs, n, state.decode, config, shared)}
    spare = _decode_spare(obs, plans["decode"]) if shared else 0.0
    plans["prefill"] = _role("prefill", obs, n, state.prefill, config, shared, spare)
    if config.hold_bursts and not smooth:
        plans = {role: _level(role, plan, obs, config) for role, plan in plans.items()}
    if not config.bounds.disaggregated:
        plans["prefill"] = _Plan(0, "none (colocated)", state.prefill, 0.0, 0.0, 0.0)
    floors = (math.ceil(plans["prefill"].need - 1e-9), math.ceil(plans["decode"].need - 1e-9))
    p, d, notes = clamp(plans["prefill"].target, plans["decode"].target, config.bounds, floors)
    wanted = {"prefill": p, "decode": d}
    flip = _flip(obs, plans, n, wanted, config) if config.flips and config.bounds.disaggregated else None
    desired_of = dict(wanted)
    if flip is not None:  # the workers it gives count in the other role now
        desired_of[flip.source] = min(wanted[flip.source], obs.role(flip.source).replicas - flip.workers)
    out: dict[str, tuple[RoleDecision, RoleState]] = {}
    for role, desired in desired_of.items():
        plan = plans[role]
        current = obs.role(role).replicas
        action = "up" if desired > current else "down" if desired < current else "hold"
        reason = plan.reason + (f" -> {wanted[role]} (bounds)" if wanted[role] != plan.target else "")
        if flip is not None and role in (flip.source, flip.target):
            reason += f" ({flip.workers} by flip {'to' if role == flip.source else 'from'} "
            reason += f"{flip.target if role == flip.source else flip.source})"
        rs = plan.state
        if action == "up":
            rs = replace(rs, last_up=obs.time, last_change=obs.time)
        elif action == "down" and wanted[role] < current:  # its own scale-down (a flip alone is none: undone in seconds)
            rs = replace(rs, last_change=obs.time, last_down=obs.time, down_from=current)
        out[role] = (RoleDecision(role, current, desired, action, reason, plan.need, plan.planned,
                                  plan.utilization), rs)
    new_state = ControllerState(prefill=out["prefill"][1], decode=out["decode"][1], load=load)
    return ScalingDecision(obs.time, out["prefill"][0], out["decode"][0], tuple(notes), new_state, flip)


def _flip(obs: Observation, plans: dict[str, _Plan], n: Needs, wanted: dict[str, int], c: LawConfig
          ) -> RoleFlip | None:
    """Flip first: a role that wants more replicas takes them from the other role where that role has more than
    it needs (it does not want more itself, sees no pressure now, and keeps what carries its planned need below
    its scale-up threshold), when a flip serves sooner than a start. Only the rest is started. A flip is undone
    in seconds, so the giving role's hysteresis (cooldowns, stabilisation window, burst memory: insurance
    against a cold start) does not hold it back."""
    for target in ROLES:
        source = other(target)
        short = wanted[target] - obs.role(target).replicas
        have = obs.role(source).replicas
        giver = plans[source]
        if short <= 0 or wanted[source] > have or giver.burst:
            continue
        keep = max(c.bounds.prefill_min if source == "prefill" else c.bounds.decode_min, giver.keep)
        k = min(short, have - min(wanted[source], keep))
        while k > 0 and not c.bounds.feasible(*_pair(target, wanted[target], min(wanted[source], have - k))):
            k -= 1
        if k <= 0:
            continue
        seconds = flip_seconds(source, obs, n, c.flip_s)
        if seconds >= c.cold_start_s:  # a start serves as soon
            continue
        return RoleFlip(source, target, k, f"{target} short by {short}; {source} carries its need on {have - k} "
                                           f"(keeps {keep}); a flip takes ~{seconds:.0f} s, a start "
                                           f"{c.cold_start_s:g} s", seconds)
    return None


def _pair(role: str, replicas: int, other_replicas: int) -> tuple[int, int]:
    """(prefill, decode) from one role's count and the other's."""
    return (replicas, other_replicas) if role == "prefill" else (other_replicas, replicas)


def _smooth(load: tuple[tuple[float, float], ...], c: LawConfig) -> bool:
    """The prompt load (tokens/s both pools computed, per observation) is smooth: over `smooth_window_s`, its
    mean per SMOOTH_BIN_S varies less than `smooth_cv` (coefficient of variation), with at least
    SMOOTH_MIN_BINS bins seen. Per 15 s, Azure conversation's prompt load varies by 0.38 and Mooncake's by
    0.25; Azure code's by 1.62 (47% of its windows are empty) and the bursty trace's by 1.19."""
    bins: dict[int, list[float]] = {}
    for t, v in load:
        bins.setdefault(math.floor(t / SMOOTH_BIN_S), []).append(v)
    if len(bins) < SMOOTH_MIN_BINS:
        return False
    means = [statistics.fmean(v) for v in bins.values()]
    mean = statistics.fmean(means)
    return mean > 0 and statistics.pstdev(means, mean) / mean < c.smooth_cv


def _decode_takes_spills(d: RoleObservation, c: LawConfig) -> bool:
    """The router spills prompts a backed-up prefill pool would queue to decode workers, and decode has room for
    them: KV does not bound its batch (beside long contexts a spilled prompt has none: on Mooncake, counting
    decode's spare compute for prefill cost 5 points of attainment)."""
    return c.spills and c.bounds.disaggregated and not _decode_kv_bound(d, c)


def _decode_spare(obs: Observation, decode: _Plan) -> float:
    """Replicas of compute decode's ready replicas have beyond its planned need at its target utilisation, which
    the prompts the router spills to them use (decode workers prefill them in their own steps)."""
    return max(0.0, obs.decode.replicas_ready * decode.utilization - decode.planned)


def _role(role: str, obs: Observation, n: Needs, rs: RoleState, c: LawConfig, shared: bool = False,
          spare: float = 0.0) -> _Plan:
    ro = obs.role(role)
    now = obs.time
    k = obs.window_seconds / SMOOTH_BIN_S  # the per-window steps below are per SMOOTH_BIN_S, whatever the interval
    rs = _correct(role, ro, n, rs, c, shared, k)
    need = _measured_need(role, ro, n, rs, c)
    u = c.target_utilization * rs.slo_factor
    if role == "prefill":  # the TTFT objective's queueing headroom, at the mean prompt of the last minutes
        mean_in = ro.mean_input_tokens if ro.arrival_rate > 0 else rs.mean_input
        w = 0.1 if k == 1.0 else 1 - 0.9 ** k  # weight of this window (per SMOOTH_BIN_S: 0.1)
        rs = replace(rs, mean_input=mean_in if rs.mean_input <= 0 else (1 - w) * rs.mean_input + w * mean_in)
        ceiling = capacity_at_slo(c.profile, c.ttft_s, c.itl_s, max(1.0, rs.mean_input), 1.0).prefill_utilization
        u = min(c.target_utilization, ceiling) * rs.slo_factor
    high, low = u * c.high_utilization / c.target_utilization, u * c.low_utilization / c.target_utilization
    if not rs.history:  # first sight: count the start as a change, so scale-down waits a full cooldown
        rs = replace(rs, last_change=now)
    history = tuple(x for x in rs.history if now - x[0] < c.trend_window_s) + ((now, need),)
    rs = replace(rs, history=history)
    if c.hold_bursts:  # kept while chasing too, so a load that stops being smooth finds its level current
        rs = replace(rs, levels=tuple(x for x in rs.levels if now - x[0] < LEVEL_WINDOW_S) + ((now, need),))
    # slow loop: re-plan once per planner period, from the forecast a cold start ahead
    recent_need = [v for t, v in history if now - t < c.smoothing_s]
    # the fast loop's need: the mean over the last SMOOTH_BIN_S (one window at the default interval): called
    # every 5 s, the law chased 5-s clumps and held what they needed
    near = [v for t, v in history if now - t < SMOOTH_BIN_S - 1e-9]
    need = sum(near) / len(near)
    smooth_need = sum(recent_need) / len(recent_need)  # one bursty window is the fast loop's, not the plan's
    if rs.planned is None or now - rs.planned_at >= c.planner_interval_s:
        ahead = forecast(history, now, c.cold_start_s + c.planner_interval_s, c.trend_window_s / 2,
                         c.max_forecast_growth)
        rs = replace(rs, planned=max(smooth_need, ahead), planned_at=now)
    planned = max(rs.planned or 0.0, smooth_need)  # a rise since the last plan counts at once
    if role == "decode" and _decode_kv_bound(ro, c):
        # a KV-bound pool's load is a stock of long contexts that swings in surges, which fill the cache faster
        # than a cold start (Mooncake, seed 5: 35% to 99% in 90 s on 4 replicas): it plans for the largest need
        # of the last minutes and a fifth more, where a minute's mean left two seeds of six under 95%
        planned = max(planned, KV_PEAK_MARGIN * _binned_max(history))
    if spare > 0:  # prefill: decode's spare compute takes the prompts spilled to it, up to a share of the plan
        planned = max(planned * (1 - SPILL_SHARE_MAX), planned - spare)
    current = ro.replicas
    warm = _warm(role, c)
    base = current - warm  # replicas that carry the need; the warm ones wait for bursts
    target = _at(planned, u) + warm
    # fast loop: a burst is sized on this window's load (not the smoothed one) plus the backlog, at full
    # utilisation (it is a transient: the plan's target keeps the queueing headroom for the lasting load)
    burst, why = _pressure(role, ro, obs, n, c)
    if burst:
        target = max(target, _at(max(planned, need) + _backlog_need(role, ro, n, c), c.max_utilization)
                     + warm, _burst_floor(role, ro, current))
    rs = _remember(rs, burst, now, max(planned, need) + _backlog_need(role, ro, n, c) if burst else 0.0, c)
    peak = _peak(rs, now, c)
    if peak > planned:  # bursts recur within the memory: keep their capacity, at full utilisation
        target = max(target, _at(peak, c.max_utilization) + warm)
    if role == "decode":
        rs = _learn_floor(rs, burst, target, now, c)
        target = max(target, math.ceil(_floor(rs, now, c) - 1e-9))
    rs = _hold(role, rs, burst, now, c)
    recent = tuple((t, v) for t, v in rs.recent if now - t < rs.hold_s) + ((now, _held(role, target, need, c, shared)),)
    rs = replace(rs, recent=recent)

    # what a flip may not take: the replicas that carry the need below the scale-up threshold; the rest (the
    # hysteresis and the burst memory, insurance against a cold start) serves the other role's need now
    keep = _at(max(planned, need), high) + warm

    def plan(replicas: int, reason: str) -> _Plan:
        return _Plan(replicas, reason, rs, need, planned, u, burst, keep)

    if target > current and (burst or planned > high * max(base, 0) or base <= 0):
        if now - rs.last_up < c.scale_up_cooldown_s:
            return plan(current, f"hold {current}: up to {target} waits for the scale-up cooldown ({why or 'load'})")
        return plan(target, f"up {current}->{target}: " + (why or f"planned need {planned:.2f} replicas > "
                                                              f"{high:.2f} of {max(base, 0)}"))
    if burst:
        return plan(current, f"hold {current}: {why}, " + ("replicas already starting" if ro.replicas_arriving
                                                            else f"which {current} replicas clear"))
    stable = max(v for _, v in recent)
    if (stable < current and planned < low * base and _calm(role, ro, c)
            and now - rs.last_change >= _base_hold(role, c)):
        down = _step_down(current, stable) if c.flips else stable
        return plan(down, f"down {current}->{down}: need {planned:.2f} < {low:.2f} of {base} for {rs.hold_s:g} s"
                          + (f" (at most half the pool a step; the window allows {stable})" if down > stable else ""))
    util = planned / base if base > 0 else 0.0
    return plan(current, f"hold {current}: utilisation {util:.2f} (target {u:.2f})")


def _warm(role: str, c: LawConfig) -> int:
    """A role's warm replicas: its own setting, or the one for both."""
    own = c.warm_prefill if role == "prefill" else c.warm_decode
    return c.warm_replicas if own is None else own


def _level(role: str, plan: _Plan, obs: Observation, c: LawConfig) -> _Plan:
    """`hold_bursts` on a load that is not smooth: the role holds a quantile of its need over the level window
    (LEVEL_QUANTILE of LEVEL_WINDOW_S) at its target utilisation, plus its warm replicas, and moves there at once
    either way; nothing is started for a burst. A burst shorter than a cold start is gone when a replica started
    for it loads, and the law's memory of it then holds what it bought. While the window is filling the
    quantile is higher, from the largest need seen at the start down to LEVEL_QUANTILE once the window is full:
    a level learned from minutes of history is a guess, and on Azure code the first quarter hour's clumps cost
    the held law more than the rest of the hour. On the bursty trace at 150-s cold starts, holding 12 + 7 warm
    replicas serves 95% of feasible requests at 1.45x the oracle's GPU-seconds, where chasing needs 1.76x; on
    Azure code 6 + 4 serves 95% at 1.12x at 20-s and 150-s cold starts, where chasing serves 92% (issue 40's
    seventh and eighth passes, docs/autoscaling.md). The state the law keeps (history, memories) goes on as if
    chasing, so a load that turns smooth finds it current."""
    levels = plan.state.levels
    filled = min(1.0, (obs.time - levels[0][0]) / LEVEL_WINDOW_S) if levels else 0.0
    q = LEVEL_QUANTILE + (1 - LEVEL_QUANTILE) * (1 - filled)
    values = sorted(v for _, v in levels) or [0.0]
    level = values[min(len(values) - 1, int(q * len(values)))]
    warm = _warm(role, c)
    target = max(1, _at(level, plan.utilization) + warm)
    return replace(plan, target=target, burst=False, keep=target,
                   reason=f"level {target}: need {level:.2f} replicas (the {q:.0%} quantile over {filled * LEVEL_WINDOW_S:.0f} s) "
                          f"+ {warm} warm (bursts held)")


def _step_down(current: int, stable: int) -> int:
    """Where one scale-down goes where workers can flip: to the stabilisation window's target, releasing at most
    half the pool (SCALE_DOWN_STEP). The window and the plan are means over minutes: a pool that falls from 7 or 10
    replicas to 2 in one step meets the next surge with 2, which neither a 150-s cold start nor a flip from a
    decode pool without spare makes good in time. Without flips the halving bought nothing, so it applies only
    with them (measurements: docs/autoscaling.md, issue 40)."""
    return max(stable, current - max(1, math.floor(current * SCALE_DOWN_STEP)))


def _binned_max(history: tuple[tuple[float, float], ...]) -> float:
    """The largest mean need of the history's SMOOTH_BIN_S bins (a peak that does not grow with the call rate)."""
    bins: dict[int, list[float]] = {}
    for t, v in history:
        bins.setdefault(math.floor(t / SMOOTH_BIN_S), []).append(v)
    return max(statistics.fmean(v) for v in bins.values())


def _burst_floor(role: str, ro: RoleObservation, current: int) -> int:
    """The least a burst asks for. Decode: one replica more (an ITL miss or requests held for seats is load the
    sizing may not see yet). Prefill: none beyond what the burst's load and backlog need: a queue those replicas
    clear is a clump already draining, and a replica bought for it loads after it is gone (on the Azure traces
    the +1 of every such window ratcheted prefill to twice the oracle's size)."""
    if role == "decode" and ro.replicas_arriving == 0:
        return ro.replicas + 1
    return current


def _base_hold(role: str, c: LawConfig) -> float:
    """A role's scale-down cooldown and base stabilisation window: the configured cooldown, or for prefill
    `prefill_scale_down_s` when set (a prefill replica drains in seconds, a decode replica for its requests'
    whole outputs). Not shorter by default: on the Azure code trace a 120 s prefill window lost 6 points of
    attainment and saved nothing, since the replicas it gave back were bought again within minutes."""
    if role == "prefill" and c.prefill_scale_down_s is not None:
        return c.prefill_scale_down_s
    return c.scale_down_cooldown_s


def _held(role: str, target: int, need: float, c: LawConfig, shared: bool) -> int:
    """What this window asks the stabilisation window to keep: its target and, for prefill, what the window's
    own load needed at full utilisation. The plan smooths the need over a minute, which hides a clump the ready
    replicas absorbed without queueing long enough to be called a burst; scaling down below it leaves the next
    such clump to a pool that could not have absorbed this one. (On the Azure code trace, the first scale-down
    took 10 replicas to 6 on a mean need of 3.9, and the clumps of the next ten minutes missed: with the busiest
    window kept it is 0.873 at 1.11x the oracle, against 0.859 at 1.29x; the other three traces did not move.
    Decode's window need, output tokens of the window's arrivals, is noise for a seat-bound pool: kept too, it
    cost Azure conversation 4% for nothing.) Not while the load is smooth and decode takes spills (`shared`):
    the busiest window is then noise, which the prompts spilled to decode absorb."""
    if role == "prefill" and not shared:
        return max(target, _at(need, c.max_utilization) + _warm(role, c))
    return target


def _floor_memory_s(c: LawConfig) -> float:
    return 6 * c.scale_down_cooldown_s if c.floor_memory_s is None else c.floor_memory_s


def _decayed(value: float, since: float, now: float, half_life_s: float) -> float:
    """`value` set at `since`, halved every `half_life_s` after it (0 when the memory is off or empty)."""
    if half_life_s <= 0 or value <= 0:
        return 0.0
    return value * 0.5 ** (max(0.0, now - since) / half_life_s)


def _floor(rs: RoleState, now: float, c: LawConfig) -> float:
    """Decode's learned floor (replicas), halved every `floor_memory_s` since it was learned."""
    return _decayed(rs.floor, rs.floor_at, now, _floor_memory_s(c))


def _learn_floor(rs: RoleState, burst: bool, target: int, now: float, c: LawConfig) -> RoleState:
    """Decode: a burst after a scale-down, before any scale-up since, shows that scale-down cut into standing
    capacity. The smaller of the replicas before it and the burst's target becomes a floor, which decays with
    a half-life of `floor_memory_s` (six scale-down cooldowns: 1,800 s by default). A decode pool holds the KV
    its prompts reserve while they wait for prefill, so a clump fills one replica's KV before any replica
    can load (the Azure code trace, scaled down to one decode replica, had 760 requests waiting for KV); its
    floor is learned from the first such miss and keeps the next clumps' KV. Prefill does not use it: with the
    busiest window kept (`_held`) it gained nothing there, and cost Mooncake 3% without."""
    if _floor_memory_s(c) <= 0 or not burst or rs.last_down <= rs.last_up:
        return rs
    learned = float(min(rs.down_from, target))
    return replace(rs, floor=learned, floor_at=now) if learned > _floor(rs, now, c) else rs


def _hold(role: str, rs: RoleState, burst: bool, now: float, c: LawConfig) -> RoleState:
    """The stabilisation window (scale-down keeps the largest target seen over it), learned from regret.

    A burst that needs replicas within a cold start after a scale-down means that scale-down was a mistake the
    cold start cannot undo in time: the window doubles (up to `max_hold_factor` x the base), so capacity
    for bursts that recur every few minutes stays. A burst later than that was not made worse by the scale-down
    (replicas kept would have idled longer than a cold start takes). A whole window without a burst halves it."""
    base = _base_hold(role, c)
    hold = rs.hold_s or base
    if burst:
        if now - rs.last_down < c.cold_start_s + c.scale_up_cooldown_s and now - rs.last_burst > hold / 4:
            hold = min(c.max_hold_factor * base, 2 * hold)
        return replace(rs, hold_s=hold, last_burst=now)
    if now - rs.last_burst > hold and hold > base:
        hold = max(base, hold / 2)
        return replace(rs, hold_s=hold, last_burst=now - hold / 2)  # halve at most once per half window
    return replace(rs, hold_s=hold)


def _memory_s(c: LawConfig) -> float:
    """The burst memory's half-life: twice the scale-down cooldown unless set (the cooldown is how long the
    cluster's owner wants capacity to outlive a trough; 600 s at the default 300 s)."""
    return 2 * c.scale_down_cooldown_s if c.burst_memory_s is None else c.burst_memory_s


def _peak(rs: RoleState, now: float, c: LawConfig) -> float:
    """The largest burst need seen, halved every `_memory_s` since it was seen (replicas)."""
    return _decayed(rs.peak_need, rs.peak_at, now, _memory_s(c))


def _remember(rs: RoleState, burst: bool, now: float, burst_need: float, c: LawConfig) -> RoleState:
    """Burst memory: a burst's need (this window's load plus its backlog) is kept as the role's peak, decaying
    with a half-life of `_memory_s`. Bursts shorter than a cold start can only be served by capacity that
    is already there; the peak keeps it while bursts recur, sized at full utilisation, so a role whose bursts
    are mild (a peak a little above the plan) pays nothing for it and one whose bursts are several times its
    base load keeps their capacity for minutes, then lets it go."""
    if not burst or _memory_s(c) <= 0:
        return rs
    peak = _peak(rs, now, c)
    return replace(rs, peak_need=max(peak, burst_need), peak_at=now) if burst_need > peak else rs


def _correct(role: str, ro: RoleObservation, n: Needs, rs: RoleState, c: LawConfig,
             shared: bool = False, k: float = 1.0) -> RoleState:
    """Learn from measurements where the profile is off for this traffic.

    - Cost (prefill): the profile prices the mean prompt; real prompts vary (attention grows with the square of
      the length) and hit prefix caches, so the busy fraction of unsaturated replicas corrects it, slowly.
    - Queueing (both): the utilisation a role can run at within its objective depends on the spread of the work
      (one long prompt holds a replica while short ones queue). A p90 over the objective lowers this role's
      utilisation target by 7% (not while its new replicas load); a p90 under half of it lets it creep back
      by 2% when even the p99 is, up to the role's `_ceiling` (an integral loop on the SLO: a role far inside its
      objectives, such as decode whose steps take a tenth of the ITL objective, runs fuller). For prefill the latency is the queue wait before a prompt's first step,
      against the part of the TTFT objective a queue may take: more replicas shorten queues, not prompts (a
      prompt whose prefill alone exceeds the objective must not push the pool up forever).
    """
    if role == "prefill" and ro.replicas_ready and n.prefill >= 0.05 and 0.02 < ro.busy_fraction < 0.9:
        ratio = min(4.0, max(0.5, ro.busy_fraction * ro.replicas_ready / n.prefill))
        gain = c.correction_gain if k == 1.0 else 1 - (1 - c.correction_gain) ** k
        rs = replace(rs, correction=(1 - gain) * rs.correction + gain * ratio)
    signals = [(lat, obj) for lat, obj, _ in _latencies(role, ro, c) if lat.p90 is not None]
    # no wind-up: while this role's new replicas load, the misses are already being answered
    if any(lat.p90 > obj for lat, obj in signals) and ro.replicas_arriving == 0:
        rs = replace(rs, slo_factor=max(c.min_slo_factor, rs.slo_factor * 0.93 ** k))
    elif signals and all(_slack(lat, obj, shared and _spill_tail(role, ro)) for lat, obj in signals):
        rs = replace(rs, slo_factor=min(_ceiling(role, ro, c) / c.target_utilization, rs.slo_factor * 1.02 ** k))
    return rs


def _slack(lat: Percentiles, objective: float, spill_tail: bool) -> bool:
    """A window far enough inside an objective for the SLO loop to run the role fuller: its p99 under half the
    objective (the tail too: attainment counts requests), or, where the tail is spill noise, its p90 under half
    and its p99 within the objective."""
    if lat.p90 is None or lat.p99 is None:
        return False
    if spill_tail:
        return lat.p90 < objective / 2 and lat.p99 < objective
    return lat.p99 < objective / 2


def _spill_tail(role: str, ro: RoleObservation) -> bool:
    """On a smooth load whose spills decode takes (the caller's gate), this role's latency tail is the spills'
    noise, which its replicas do not shorten: a decode step that carries a spilled prompt's chunk is a long
    inter-token gap for every sequence in it, and a spilled prompt's wait is counted where it spilled from. On the
    Azure conversation trace decode's ITL p99 stayed at 0.05-0.06 s with 11 replicas as with 8, and held decode's
    target under 0.9 through its first minutes, where the oracle ran 7 replicas. Not for a decode pool of fewer
    than SPILL_TAIL_MIN_DECODE replicas: there one replica is a third of the pool or more, and its p99 is its own
    saturation (on the generated bursty trace's calm first minutes, a fuller 2-replica pool met the first burst
    with 1, and the hour cost 0.11x the oracle's GPU-seconds more; 0.07-0.12x on five seeds of six)."""
    return role == "prefill" or ro.replicas_ready >= SPILL_TAIL_MIN_DECODE


def _ceiling(role: str, ro: RoleObservation, c: LawConfig) -> float:
    """The highest utilisation target slack may raise a role to: `max_utilization`, or for a decode pool whose
    batch KV does not bound (max_num_seqs sequences of the mean context fit KV_HEADROOM of the cache)
    `decode_compute_utilization`, above 1. Decode's need prices every output token in a decode-only step at
    the largest batch, which pays one weight read per max_num_seqs tokens; a pool that also prefills computes
    most of its decode tokens inside prompt chunks whose weight read is paid already (on the H200 profile at
    1,400-token contexts, 101 µs a token against 122 µs), so its flat-out need overstates its work by up to a fifth.
    With KV bounding the batch, occupancy is the need and a fuller pool has no room for the next long prompt
    (a 1.1 ceiling for every decode pool cost Mooncake, 10,000–16,000-token contexts, 3 points; gated, Azure
    conversation 1.24x -> 1.19x the oracle with Mooncake unchanged)."""
    if role != "decode" or c.decode_compute_utilization is None or _decode_kv_bound(ro, c):
        return c.max_utilization
    return max(c.max_utilization, c.decode_compute_utilization)


def _decode_kv_bound(ro: RoleObservation, c: LawConfig) -> bool:
    """KV bounds decode's batch: max_num_seqs sequences of the mean context do not fit KV_HEADROOM of the cache
    (or no context was seen yet)."""
    return (ro.mean_input_tokens <= 0
            or kv_sequences(c.profile, ro.mean_input_tokens, ro.mean_output_tokens) < c.profile.max_num_seqs)


def _latency(role: str, ro: RoleObservation, c: LawConfig) -> tuple[Percentiles, float, str]:
    """The latency replicas of this role shorten most, its objective and its name: prefill's queue wait (or,
    where the workers do not report it, TTFT against the whole objective); decode's inter-token latency."""
    return _latencies(role, ro, c)[0]


def _latencies(role: str, ro: RoleObservation, c: LawConfig) -> list[tuple[Percentiles, float, str]]:
    """Every latency this role's replicas shorten, with its objective: for decode also the wait of a request
    between its KV landing and its first decode step (seats and KV are decode's share of TTFT)."""
    queue_budget = c.burst_queue_fraction * c.ttft_s  # the part of the TTFT objective a queue may take
    if role == "decode":
        out = [(ro.itl, c.itl_s, "ITL")]
        return out + [(ro.queue_wait, queue_budget, "decode admission wait")] if ro.queue_wait.count else out
    if ro.queue_wait.count:
        return [(ro.queue_wait, _prefill_queue_budget(ro, c), "prefill queue wait")]
    return [(ro.ttft, c.ttft_s, "TTFT")]


def _prefill_queue_budget(ro: RoleObservation, c: LawConfig) -> float:
    """s a prompt may wait for a prefill replica within the TTFT objective: what is left after a long prompt's
    own prefill (TTFT_TAIL x the mean prompt's: the p90 of exponential lengths), at least `burst_queue_fraction`
    of the objective. Half the objective for every trace made prefill's SLO loop run the Azure conversation
    trace's pool (prefill 0.04 s per mean prompt) at 0.6 utilisation for a 1 s queue its prompts did not need."""
    s_mean = c.profile.prefill_seconds(max(1, round(ro.mean_input_tokens))) + c.profile.kv_transfer_tail_s
    return max(c.burst_queue_fraction * c.ttft_s, c.ttft_s - TTFT_TAIL * s_mean)


def _measured_need(role: str, ro: RoleObservation, n: Needs, rs: RoleState, c: LawConfig) -> float:
    """This window's need: the profile's, corrected (prefill), or what decode holds now if that is more
    (its KV and seats in use: requests stay for their whole output, so occupancy is load too)."""
    if role == "prefill":
        return n.prefill * rs.correction
    occupancy = max(ro.kv_usage / KV_HEADROOM,
                    ro.num_running / (max(1, ro.replicas_ready) * c.profile.max_num_seqs)) * ro.replicas_ready
    return max(n.decode, occupancy)


def _at(need: float, utilization: float) -> int:
    return max(0, math.ceil(need / utilization - 1e-9))


def _pressure(role: str, ro: RoleObservation, obs: Observation, n: Needs, c: LawConfig) -> tuple[bool, str]:
    """Is this role the one queueing or missing its objective now, and why."""
    d = obs.decode
    if role == "prefill":
        if ro.replicas_ready == 0 and (ro.num_waiting > 0 or ro.arrival_rate > 0):
            return True, "no ready prefill replica"
        if n.prefill_backlog_s > c.burst_queue_fraction * c.ttft_s:
            return True, (f"queue of {ro.waiting_prefill_tokens} tokens drains in {n.prefill_backlog_s:.2f} s "
                          f"> {c.burst_queue_fraction:g} x TTFT objective")
        latency, objective, name = _latency(role, ro, c)
        if (latency.over(objective) and ro.num_waiting > ro.replicas_ready
                and not _decode_short(d, c, n.capacity.decode_step_s)):
            return True, f"{name} p90 {latency.p90:.2f} s > {objective:g} s with {ro.num_waiting} prompts queued"
        return False, ""
    if ro.itl.over(c.itl_s):
        return True, f"ITL p90 {ro.itl.p90 * 1e3:.0f} ms > {c.itl_s * 1e3:.0f} ms"
    if _decode_short(ro, c, n.capacity.decode_step_s):
        return True, f"{ro.num_waiting} requests wait for decode KV or seats (KV {ro.kv_usage:.0%})"
    return False, ""


def _decode_short(d: RoleObservation, c: LawConfig, step_s: float) -> bool:
    """Decode workers hold requests back for KV blocks or seats long enough to hurt TTFT (decode's fault).

    A seat frees when a running request ends: about running / (mean output x step) seats per second, so the
    queue waits about waiting / that; a burst is when that is a good part of the TTFT objective."""
    seats_full = d.num_running >= 0.9 * d.replicas_ready * c.profile.max_num_seqs
    if d.num_waiting <= max(1, d.replicas_ready) or not (d.kv_usage > c.kv_high or seats_full):
        return False
    turnover = d.num_running / max(1e-9, max(1.0, d.mean_output_tokens) * step_s)  # seats freed per s
    return d.num_waiting / max(turnover, 1e-9) > c.burst_queue_fraction * c.ttft_s


def _backlog_need(role: str, ro: RoleObservation, n: Needs, c: LawConfig) -> float:
    """Extra replicas to clear the backlog within a cold start (new replicas help only once loaded)."""
    horizon = c.cold_start_s + c.ttft_s
    if role == "prefill":
        return ro.waiting_prefill_tokens / (n.capacity.prefill_raw_tokens_per_s * horizon)
    return ro.num_waiting * ro.mean_output_tokens / (n.capacity.decode_tokens_per_s * horizon)


def _calm(role: str, ro: RoleObservation, c: LawConfig) -> bool:
    """No sign of trouble: scale-down may go ahead."""
    latency, objective, _ = _latency(role, ro, c)
    if role == "prefill":
        return not latency.over(objective) and ro.num_waiting <= ro.replicas_ready
    return not latency.over(objective) and ro.num_waiting == 0 and ro.kv_usage < c.kv_high
