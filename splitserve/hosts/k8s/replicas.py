"""How many workers each role gets: a `DesiredReplicas` provider says what is wanted (the spec, the scale
subresource, or the SLO control law: `slo.py`), then the cluster's hard bounds (min/max, the
prefill:decode ratio, the GPU budget; `autoscaler.bounds`, shared with the control law) clamp it. A bound that
no pair can meet is `Unrealisable`: the operator reports it as Degraded instead of applying anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.autoscaler.bounds import Bounds, clamp
from splitserve.autoscaler.flips import RoleFlip
from splitserve.common.config import ClusterSpec


@dataclass(frozen=True)
class Observed:
    """What the operator read in this pass, for a provider to decide from."""

    role_replicas: dict[str, int] = field(default_factory=dict)  # SplitServeRoles' spec.replicas (absent: none yet)
    ready: dict[str, int] = field(default_factory=dict)  # ready pods per component
    cluster: str = ""  # the SplitServeCluster's name and namespace (a provider's per-cluster state)
    namespace: str = ""
    law_state: dict[str, Any] | None = None  # status.lawState: the control law's memory the last pass kept


@dataclass(frozen=True)
class Wanted:
    """Replicas a provider asks for, before the bounds."""

    prefill: int
    decode: int
    source: str  # where the numbers come from, for status.lastDecision.reason
    law_state: dict[str, Any] | None = None  # the control law's memory to keep in status.lawState (slo/external)
    flip: RoleFlip | None = None  # workers to move between the roles first (counted in prefill/decode already)


DesiredReplicas = Callable[[ClusterSpec, Observed], Wanted]


def spec_or_scale(spec: ClusterSpec, observed: Observed) -> Wanted:
    """The default provider. external: what HPA/KEDA wrote on the SplitServeRoles' scale subresource (the spec's
    replicas until they exist); manual: the spec's replicas; slo: the spec's replicas (the control law
    is `slo.SloReplicas`, which `splitserve operator` passes as `Deps.desired`)."""
    prefill, decode = spec.prefill.replicas, spec.decode.replicas
    mode = spec.autoscaling.mode
    if mode == "external" and observed.role_replicas:
        return Wanted(observed.role_replicas.get("prefill", prefill), observed.role_replicas.get("decode", decode),
                      "external: the SplitServeRoles' scale subresource")
    if mode == "slo":
        return Wanted(prefill, decode, "slo: no control law plugged in yet, holding spec replicas")
    return Wanted(prefill, decode, f"{mode}: spec replicas")


class Unrealisable(Exception):
    """A spec the schema accepts but no deployment can satisfy; becomes the Degraded condition."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # CamelCase, the condition's reason
        self.message = message


@dataclass(frozen=True)
class ReplicaDecision:
    prefill: int
    decode: int
    reason: str
    law_state: dict[str, Any] | None = None  # status.lawState (None: no law runs; the field is dropped)
    flip: RoleFlip | None = None  # the law's role flip, applied before the Deployments are sized


def decide(spec: ClusterSpec, wanted: Wanted) -> ReplicaDecision:
    """`wanted` clamped into the bounds, with the reason; raises Unrealisable when no pair meets them all."""
    b = Bounds.from_spec(spec)
    prefill_min = b.prefill_min if b.disaggregated else 0
    need = (prefill_min + b.decode_min) * b.gpus_per_replica
    if b.gpu_budget is not None and need > b.gpu_budget:
        raise Unrealisable("GPUBudgetTooSmall",
                           f"autoscaling.gpuBudget: {b.gpu_budget} GPUs, but the minimum replicas ({prefill_min} prefill "
                           f"+ {b.decode_min} decode, {b.gpus_per_replica} GPU each) need {need}")
    prefill, decode, notes = clamp(wanted.prefill, wanted.decode, b)
    if "bounds_infeasible" in notes:
        lo = "" if b.ratio_min is None else f"{b.ratio_min:g}"
        hi = "" if b.ratio_max is None else f"{b.ratio_max:g}"
        raise Unrealisable("RatioBoundsUnsatisfiable",
                           f"ratio: no prefill:decode within {lo}..{hi} fits prefill {b.prefill_min}..{b.prefill_max} "
                           f"and decode {b.decode_min}..{b.decode_max} replicas"
                           + ("" if b.gpu_budget is None else f" within autoscaling.gpuBudget {b.gpu_budget}"))
    reason = wanted.source
    if (prefill, decode) != (wanted.prefill if b.disaggregated else 0, wanted.decode):
        reason += (f"; asked prefill {wanted.prefill}, decode {wanted.decode}, clamped by "
                   + (", ".join(notes) or "the bounds"))
    return ReplicaDecision(prefill, decode, reason, wanted.law_state, wanted.flip)
