"""One experiment: a set of requests, a cluster spec and a profile; run any policy on it (ours, a static P:D,
the oracle, an anchor's law) and summarise it against the oracle. The CLI (`splitserve simulate`) and
benchmarks/autoscaling.py both use this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.autoscaler.bounds import Bounds
from splitserve.autoscaler.law import LawConfig
from splitserve.autoscaler.profile import ReplicaProfile
from splitserve.autoscaler.sim.laws import DynamoLoadLaw, RayLaw, ScalingLaw, SLOLaw, WVALaw
from splitserve.autoscaler.sim.oracle import OracleResult, StaticChoice, best_static, oracle
from splitserve.autoscaler.sim.report import summary
from splitserve.autoscaler.sim.simulator import SimResult, SimSettings, fresh, simulate
from splitserve.autoscaler.sim.trace import SimRequest
from splitserve.common.config import ClusterSpec

POLICIES = ("slo", "oracle", "static", "ray", "wva", "dynamo")


@dataclass
class Experiment:
    requests: list[SimRequest]
    spec: ClusterSpec  # SLOs, autoscaling parameters, bounds, the router's policy
    profile: ReplicaProfile
    window_s: float = 300.0  # the oracle's window
    target: float = 0.95  # attainment the oracle and the best static must reach
    law_overrides: dict[str, Any] = field(default_factory=dict)  # LawConfig fields (experiments, tests)
    _oracle: OracleResult | None = None
    _static: StaticChoice | None = None

    @property
    def settings(self) -> SimSettings:
        s = self.spec
        return SimSettings(self.profile, ttft_s=s.slo.ttft_seconds, itl_s=s.slo.itl_seconds,
                           disagg_threshold=s.decode.disagg_threshold, routing=s.router.policy,
                           spill_prefill_tokens=s.router.spill.prefill_backlog_tokens,
                           spill_local_tokens=s.router.spill.local_backlog_tokens,
                           spill_local_share=s.router.spill.local_share,
                           spill_handover_tokens=s.router.spill.handover_tokens,
                           block_size=s.model.block_size, gpus_per_replica=s.model.tensor_parallel_size,
                           cold_start_s=s.autoscaling.cold_start_seconds, engine=s.engine_of("decode"),
                           flips=s.autoscaling.role_flips and s.mode == "disaggregated",
                           flip_s=s.autoscaling.flip_seconds, drain_seconds=s.decode.drain_seconds,
                           reserve_wait_s=s.decode.reserve_wait_seconds,
                           queue_timeout_s=s.router.queue_timeout_seconds, bounds=Bounds.from_spec(s))

    @property
    def budget(self) -> int | None:
        return self.spec.autoscaling.gpu_budget

    @property
    def max_replicas(self) -> int:
        return max(self.spec.prefill.max_replicas, self.spec.decode.max_replicas)

    def oracle(self) -> OracleResult:
        if self._oracle is None:
            self._oracle = oracle(self.requests, self.settings, self.window_s, self.target, self.max_replicas,
                                  self.budget)
        return self._oracle

    def best_static(self) -> StaticChoice:
        if self._static is None:
            ws = self.oracle().windows
            upper = (max(w.prefill for w in ws), max(w.decode for w in ws)) if ws else None
            self._static = best_static(self.requests, self.settings, self.target, self.max_replicas, self.budget,
                                       upper)
        return self._static

    def initial(self) -> tuple[int, int]:
        """Where every dynamic law starts: the oracle's plan for the first window (ready, loaded)."""
        first = self.oracle().windows[0]
        return max(1, first.prefill), max(1, first.decode)

    def law(self, name: str) -> ScalingLaw:
        s, a = self.spec, self.spec.autoscaling
        top = self.max_replicas
        if name == "slo":
            cfg = LawConfig.from_spec(s, self.profile, **self.law_overrides)
            return SLOLaw(cfg, interval_s=a.interval_seconds)
        if name == "ray":
            return RayLaw(s.slo.ttft_seconds, a.scale_up_cooldown_seconds, a.scale_down_cooldown_seconds, top,
                          interval_s=a.interval_seconds)
        if name == "wva":
            return WVALaw(a.scale_up_cooldown_seconds, a.scale_down_cooldown_seconds, max_replicas=top,
                          interval_s=a.interval_seconds)
        if name == "dynamo":
            return DynamoLoadLaw(self.profile, s.slo.ttft_seconds, s.slo.itl_seconds, max_replicas=top)
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")

    def run(self, name: str) -> tuple[dict[str, Any], SimResult | None]:
        """The policy's summary (with the oracle's cost beside it) and its run (None for the oracle)."""
        orc = self.oracle()
        res: SimResult | None
        if name == "oracle":
            res = None
            out = {"policy": "oracle", "requests": len(self.requests), "slo_attainment": round(orc.attainment, 4),
                   "gpu_seconds": round(orc.gpu_seconds, 1), "windows": [(w.prefill, w.decode) for w in orc.windows],
                   "max_gpus": max((w.prefill + w.decode for w in orc.windows), default=0)
                   * self.spec.model.tensor_parallel_size}
        elif name == "static":
            choice = self.best_static()
            res = choice.result
            out = summary(res) | {"static": [choice.prefill, choice.decode]}
        else:
            res = simulate(fresh(self.requests), self.settings, self.law(name), self.initial())
            out = summary(res)
        out["oracle_gpu_seconds"] = round(orc.gpu_seconds, 1)
        out["oracle_slo_attainment"] = round(orc.attainment, 4)
        out["gpu_seconds_vs_oracle"] = round(out["gpu_seconds"] / orc.gpu_seconds, 3) if orc.gpu_seconds else None
        return out, res
