"""The hard limits on a decision: each role's min/max replicas, the prefill:decode ratio bounds and the GPU
budget (replicas × tensorParallelSize). `clamp` picks the feasible (prefill, decode) pair closest to what the
loops want, and says which limit moved it. Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.common.config import ClusterSpec


@dataclass(frozen=True)
class Bounds:
    prefill_min: int = 0
    prefill_max: int = 8
    decode_min: int = 1
    decode_max: int = 8
    ratio_min: float | None = None  # prefill / decode at least this
    ratio_max: float | None = None  # prefill / decode at most this
    gpu_budget: int | None = None  # GPUs for all workers together
    gpus_per_replica: int = 1  # tensorParallelSize x a decode worker's dataParallelSize
    disaggregated: bool = True  # colocated clusters have no prefill pool

    @classmethod
    def from_spec(cls, spec: ClusterSpec) -> Bounds:
        """The hard limits a SplitServeCluster spec declares."""
        return cls(prefill_min=spec.prefill.min_replicas, prefill_max=spec.prefill.max_replicas,
                   decode_min=max(1, spec.decode.min_replicas), decode_max=spec.decode.max_replicas,
                   ratio_min=spec.ratio.min, ratio_max=spec.ratio.max, gpu_budget=spec.autoscaling.gpu_budget,
                   gpus_per_replica=spec.gpus_per_worker("decode"), disaggregated=spec.mode == "disaggregated")

    def feasible(self, p: int, d: int) -> bool:
        return (self.prefill_min <= p <= self.prefill_max and self.decode_min <= d <= self.decode_max
                and self._ratio_ok(p, d) and self._budget_ok(p, d))

    def _ratio_ok(self, p: int, d: int) -> bool:
        if not self.disaggregated:
            return True
        if d == 0:
            return self.ratio_max is None
        r = p / d
        return (self.ratio_min is None or r >= self.ratio_min - 1e-9) and (self.ratio_max is None or r <= self.ratio_max + 1e-9)

    def _budget_ok(self, p: int, d: int) -> bool:
        return self.gpu_budget is None or (p + d) * self.gpus_per_replica <= self.gpu_budget

    def _decode_range(self, p: int) -> tuple[int, int]:
        lo, hi = self.decode_min, self.decode_max
        if self.disaggregated and self.ratio_max is not None:
            lo = max(lo, math.ceil(p / self.ratio_max - 1e-9))
        if self.disaggregated and self.ratio_min is not None and self.ratio_min > 0:
            hi = min(hi, math.floor(p / self.ratio_min + 1e-9))
        if self.gpu_budget is not None:
            hi = min(hi, self.gpu_budget // self.gpus_per_replica - p)
        return lo, hi


def clamp(prefill: int, decode: int, bounds: Bounds, floors: tuple[int, int] | None = None
          ) -> tuple[int, int, list[str]]:
    """The feasible pair closest to (prefill, decode), and notes naming each limit that moved it.

    Closest means: first the smallest shortfall below `floors` (what each role's load needs flat out: the
    larger of the two roles' missing fractions), then the smallest shortfall below what each wanted, then the
    fewest GPUs, then the smallest distance. So a ratio bound raises the other role rather than starving this
    one, and a budget cap covers both roles' loads before either role's headroom.
    """
    fp, fd = floors if floors is not None else (prefill, decode)
    if not bounds.disaggregated:
        prefill = 0
        lo, hi = bounds.decode_min, bounds.decode_max
        if bounds.gpu_budget is not None:
            hi = min(hi, bounds.gpu_budget // bounds.gpus_per_replica)
        d = min(max(decode, lo), max(lo, hi))
        return 0, d, _notes(0, decode, 0, d, bounds)
    if bounds.feasible(prefill, decode):
        return prefill, decode, []
    best: tuple[tuple[float, float, int, int], int, int] | None = None
    for p in range(bounds.prefill_min, bounds.prefill_max + 1):
        lo, hi = bounds._decode_range(p)
        if lo > hi:
            continue
        for d in range(lo, min(hi, max(decode, lo)) + 1):  # more decode than wanted never helps
            key = (round(max(_short(fp, p), _short(fd, d)), 9), round(max(_short(prefill, p), _short(decode, d)), 9),
                   p + d, abs(p - prefill) + abs(d - decode))
            if best is None or key < best[0]:
                best = (key, p, d)
    if best is None:  # no pair meets every bound: keep the minimums, say so
        return bounds.prefill_min, bounds.decode_min, ["bounds_infeasible"]
    _, p, d = best
    return p, d, _notes(prefill, decode, p, d, bounds)


def _short(want: int, got: int) -> float:
    return max(0, want - got) / want if want > 0 else 0.0


def _notes(p_want: int, d_want: int, p: int, d: int, b: Bounds) -> list[str]:
    notes = []
    for role, want, got, lo, hi in (("prefill", p_want, p, b.prefill_min, b.prefill_max),
                                    ("decode", d_want, d, b.decode_min, b.decode_max)):
        if want == got:
            continue
        if want < lo and got == lo:
            notes.append(f"{role}.minReplicas {lo}")
        elif want > hi and got == hi:
            notes.append(f"{role}.maxReplicas {hi}")
    if b.disaggregated and (p, d) != (p_want, d_want):
        if b.ratio_min is not None and d_want and p_want / d_want < b.ratio_min - 1e-9:
            notes.append(f"ratio.min {b.ratio_min:g}")
        if b.ratio_max is not None and d_want and p_want / d_want > b.ratio_max + 1e-9:
            notes.append(f"ratio.max {b.ratio_max:g}")
    if b.gpu_budget is not None and (p_want + d_want) * b.gpus_per_replica > b.gpu_budget:
        notes.append(f"gpuBudget {b.gpu_budget}")
    return notes
