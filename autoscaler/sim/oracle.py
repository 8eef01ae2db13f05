"""Baselines that know the future: the oracle (the cheapest static P:D for each 5-minute window that meets the
SLO in that window) and the best static P:D for the whole trace.

The oracle replays each window's arrivals alone on a ready cluster (no cold start, nothing carried over,
replicas changed for free between windows) and pays (P + D) x window length; it is the reference cost.
"Meets the SLO" is attainment >= `target` x the fraction of requests an idle cluster could serve in time (a
prompt whose prefill alone is longer than the TTFT objective misses it whatever the replicas); where even a
large cluster cannot reach that, the target is that large cluster's attainment minus half a point.
Searches assume attainment grows with replicas: the fewest prefill replicas with plenty of decode, then the
fewest decode replicas with that prefill, then more prefill for fewer decode while the pair gets cheaper.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.autoscaler.profile import capacity_at_slo
from splitserve.autoscaler.sim.laws import StaticLaw
from splitserve.autoscaler.sim.simulator import SimResult, SimSettings, fresh, simulate
from splitserve.autoscaler.sim.trace import SimRequest

SLACK = 0.005  # attainment below the best reachable that still counts as meeting an unreachable target


@dataclass
class WindowPlan:
    start: float  # s
    length: float  # s
    prefill: int
    decode: int
    requests: int
    met: int  # requests within both objectives at this plan
    target: float  # the attainment this window had to reach
    sims: int  # simulations the search ran


@dataclass
class OracleResult:
    windows: list[WindowPlan] = field(default_factory=list)

    @property
    def gpu_seconds(self) -> float:
        return sum((w.prefill + w.decode) * w.length for w in self.windows)

    @property
    def attainment(self) -> float:
        n = sum(w.requests for w in self.windows)
        return sum(w.met for w in self.windows) / n if n else 1.0

    @property
    def sims(self) -> int:
        return sum(w.sims for w in self.windows)


def shifted(requests: list[SimRequest], start: float) -> list[SimRequest]:
    """A window's requests as a trace of their own: arrivals from `start`, ids 0..n-1 (replayed alone)."""
    return [SimRequest(i, r.arrival - start, r.prompt, r.output, r.hash_ids, r.hash_block)
            for i, r in enumerate(requests)]


def lower_bounds(requests: list[SimRequest], settings: SimSettings, span_s: float) -> tuple[int, int]:
    """Replicas that the window's mean load needs flat out (a floor for the searches)."""
    if not requests:
        return 1, 1
    prof = settings.profile
    mean_in = sum(r.prompt for r in requests) / len(requests)
    mean_out = sum(r.output for r in requests) / len(requests)
    cap = capacity_at_slo(prof, settings.ttft_s, settings.itl_s, mean_in, mean_out, max_utilization=1.0)
    remote_tokens = sum(r.prompt for r in requests if r.prompt >= settings.disagg_threshold)
    p = math.floor(remote_tokens / span_s / cap.prefill_raw_tokens_per_s)
    d = math.floor(sum(r.output for r in requests) / span_s / cap.decode_tokens_per_s)
    return max(1 if remote_tokens else 0, p), max(1, d)


def _search(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The smallest n in [lo, hi] with ok(n), assuming ok is monotone; None if even hi fails."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


class _Evaluator:
    """Attainment of a static (P, D) over some requests, memoised."""

    def __init__(self, requests: list[SimRequest], settings: SimSettings) -> None:
        self.requests, self.settings = requests, settings
        self.memo: dict[tuple[int, int], SimResult] = {}

    def __call__(self, p: int, d: int) -> SimResult:
        if (p, d) not in self.memo:
            self.memo[(p, d)] = simulate(fresh(self.requests), self.settings, StaticLaw(p, d), (p, d))
        return self.memo[(p, d)]

    def met(self, p: int, d: int) -> int:
        s = self.settings
        return sum(r.meets(s.ttft_s, s.itl_s) for r in self(p, d).requests)


@dataclass
class StaticChoice:
    prefill: int
    decode: int
    met: int  # requests within both objectives
    target: float  # the attainment it had to reach
    sims: int  # simulations the search ran
    result: SimResult  # the chosen pair's run


def cheapest_static(requests: list[SimRequest], settings: SimSettings, span_s: float, target: float,
                    max_replicas: int, budget: int | None, upper: tuple[int, int] | None = None) -> StaticChoice:
    """The cheapest static pair reaching `target` over `requests` (which arrive over `span_s`); `upper` is a
    pair believed to reach it (the search starts there instead of growing from the mean load)."""
    ev = _Evaluator(requests, settings)
    n = len(requests)
    if n:
        target *= sum(settings.feasible(r) for r in requests) / n
    p0, d0 = lower_bounds(requests, settings, span_s)
    cap = max_replicas if budget is None else max(1, budget // settings.gpus_per_replica - 1)
    p_hi = min(cap, max(2 * p0 + 2, 2)) if upper is None else min(cap, max(upper[0], p0, 1))
    d_hi = min(cap, max(2 * d0 + 2, 2)) if upper is None else min(cap, max(upper[1], d0, 1))
    while budget is None or p_hi + d_hi <= budget // settings.gpus_per_replica:  # grow until it meets the target
        if ev.met(p_hi, d_hi) >= target * n or (p_hi >= cap and d_hi >= cap):
            break
        grown = (min(cap, 2 * p_hi), min(cap, 2 * d_hi))
        if grown == (p_hi, d_hi):
            break
        p_hi, d_hi = grown
    best_met = ev.met(p_hi, d_hi)
    if best_met < target * n:  # unreachable here: aim just under what the large cluster gets
        target = best_met / n - SLACK if n else target
    need = target * n - 1e-9
    p = _search(min(p0, p_hi), p_hi, lambda x: ev.met(x, d_hi) >= need)
    p = p_hi if p is None else p
    d = _search(min(d0, d_hi), d_hi, lambda x: ev.met(p, x) >= need)
    d = d_hi if d is None else d
    p, d = _trade(ev, p, d, p_hi, min(d0, d), need)
    return StaticChoice(p, d, ev.met(p, d), target, len(ev.memo), ev(p, d))


def _trade(ev: _Evaluator, p: int, d: int, p_hi: int, d_lo: int, need: float) -> tuple[int, int]:
    """The fewest prefill replicas with plenty of decode may be a costly pair: decode workers prefill prompts
    themselves (short ones, and long ones that spill from a backed-up prefill worker), so plenty of decode lets
    prefill go low, and then it takes many decode replicas. Walk prefill up, each with its fewest decode (no
    more than the last pair's: more prefill never needs more decode), while the pair gets cheaper (two steps
    without a gain end it)."""
    best, q, misses = (p + d, p, d), p, 0
    while misses < 2 and q < p_hi:
        q += 1
        if q + d_lo >= best[0]:
            break
        top = best[2]
        dq = _search(min(d_lo, top), top, lambda x, q=q: ev.met(q, x) >= need)
        if dq is not None and q + dq < best[0]:
            best, misses = (q + dq, q, dq), 0
        else:
            misses += 1
    return best[1], best[2]


def oracle(requests: list[SimRequest], settings: SimSettings, window_s: float = 300.0, target: float = 0.95,
           max_replicas: int = 64, budget: int | None = None) -> OracleResult:
    """The cheapest static P:D per window of arrivals."""
    out = OracleResult()
    if not requests:
        return out
    end = requests[-1].arrival
    k = 0
    while k * window_s <= end:
        start = k * window_s
        chosen = [r for r in requests if start <= r.arrival < start + window_s]
        length = min(window_s, max(end - start, 1e-3))
        k += 1
        if not chosen:
            continue
        c = cheapest_static(shifted(chosen, start), settings, length, target, max_replicas, budget)
        out.windows.append(WindowPlan(start, length, c.prefill, c.decode, len(chosen), c.met, c.target, c.sims))
    return out


def best_static(requests: list[SimRequest], settings: SimSettings, target: float = 0.95, max_replicas: int = 64,
                budget: int | None = None, upper: tuple[int, int] | None = None) -> StaticChoice:
    """The cheapest static P:D reaching `target` over the whole trace, and its run (`upper`: e.g. the oracle's
    largest window plan)."""
    span = max(requests[-1].arrival, 1.0) if requests else 1.0
    return cheapest_static(requests, settings, span, target, max_replicas, budget, upper)
