"""What every live actuator of the control law shares (the operator, `splitserve up --autoscale`): one
`Autoscaler` per cluster that, at most once per `autoscaling.intervalSeconds`, observes the cluster
(`observer.Observer`), calls the law (`law.decide`, never a copy of it), keeps its state, logs the decision with
its reason (structured, stderr) and exports it as metrics. Applying the decision is the actuator's own part.

Metrics (the process's default registry; the gateway-free launcher and the operator serve them):
`splitserve_autoscaler_desired_replicas{cluster,role}` (KEDA/HPA read it in external mode),
`splitserve_autoscaler_decisions_total{cluster,role,direction}` and
`splitserve_autoscaler_replicas{cluster,role,state}` (ready/starting/draining, as observed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from prometheus_client import Counter, Gauge

from splitserve.autoscaler.law import ROLES, ControllerState, LawConfig, ScalingDecision, decide
from splitserve.autoscaler.observations import Observation
from splitserve.autoscaler.observer import Observer
from splitserve.autoscaler.profile import PROFILE_DIR, ReplicaProfile
from splitserve.common.config import ClusterSpec

log = logging.getLogger("splitserve.autoscaler")
DESIRED = Gauge("splitserve_autoscaler_desired_replicas", "Replicas the SLO control law wants per role",
                ["cluster", "role"])
DECISIONS = Counter("splitserve_autoscaler_decisions", "Control-law decisions per role and direction (up/down/hold)",
                    ["cluster", "role", "direction"])
OBSERVED = Gauge("splitserve_autoscaler_replicas", "Replicas per role and state as the autoscaler last observed them",
                 ["cluster", "role", "state"])

PROFILES = {"cpu": PROFILE_DIR / "cpu2_smollm2.json", "gpu": PROFILE_DIR / "h200_8b.json"}


def default_profile(spec: ClusterSpec, gpu: bool | None = None) -> Path:
    """The committed replica profile that fits the cluster: this repository's CPU calibration (SmolLM2) for CPU
    workers, the 8B-shaped H200 one otherwise. `gpu` None: guessed from model.device."""
    if gpu is None:
        gpu = spec.model.device.startswith("cuda")
    return PROFILES["gpu" if gpu else "cpu"]


def load_profile(path: str | Path) -> ReplicaProfile:
    """A replica profile JSON (`splitserve simulate --calibrate` writes one); ValueError naming the file."""
    try:
        return ReplicaProfile.load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"replica profile {path}: {e}") from None


class Autoscaler:
    """The law's loop for one cluster: `tick(expected)` observes and decides when an interval has passed
    (None otherwise). `expected`: replicas per role the actuator has asked for (those not ready yet count as
    starting). The first tick only primes the observer's window."""

    def __init__(self, cluster: str, spec: ClusterSpec, observer: Observer | Callable[..., Observation],
                 profile: ReplicaProfile, clock: Callable[[], float] = time.monotonic,
                 state: ControllerState | None = None) -> None:
        self.cluster = cluster
        self.observe = observer.observe if isinstance(observer, Observer) else observer
        self.clock = clock
        self.state = state or ControllerState()
        self.profile = profile
        self.last: ScalingDecision | None = None
        self.observation: Observation | None = None
        self._primed = False
        self._next_at = -float("inf")
        self.configure(spec)

    def configure(self, spec: ClusterSpec) -> None:
        """Take a changed spec (SLOs, cooldowns, bounds); the law's state is kept."""
        self.spec = spec
        self.config = LawConfig.from_spec(spec, self.profile)
        self.interval_s = spec.autoscaling.interval_seconds

    def tick(self, expected: Mapping[str, int]) -> ScalingDecision | None:
        now = self.clock()
        if now < self._next_at:
            return None
        self._next_at = now + self.interval_s
        obs = self.observe(expected)
        self.observation = obs
        self._export_observed(obs)
        if not self._primed:
            self._primed = True
            return None
        decision = decide(obs, self.state, self.config)
        self.state = decision.state
        self.last = decision
        self._record(decision, obs)
        return decision

    def _export_observed(self, obs: Observation) -> None:
        for role in ROLES:
            ro = obs.role(role)
            for state, n in (("ready", ro.replicas_ready), ("starting", ro.replicas_starting),
                             ("draining", ro.replicas_draining)):
                OBSERVED.labels(self.cluster, role, state).set(n)

    def _record(self, decision: ScalingDecision, obs: Observation) -> None:
        for role in ROLES:
            rd = getattr(decision, role)
            DESIRED.labels(self.cluster, role).set(rd.desired)
            DECISIONS.labels(self.cluster, role, rd.action).inc()
        seen = {role: {"ready": obs.role(role).replicas_ready, "starting": obs.role(role).replicas_starting,
                       "draining": obs.role(role).replicas_draining, "waiting": obs.role(role).num_waiting,
                       "waiting_prefill_tokens": obs.role(role).waiting_prefill_tokens,
                       "running": obs.role(role).num_running} for role in ROLES}
        level = logging.INFO if decision.changed else logging.DEBUG
        log.log(level, "autoscaler decision: %s", decision.reason,
                extra={"fields": {"cluster": self.cluster, "decision": decision.as_status(), "observed": seen,
                                  "window_s": round(obs.window_seconds, 3)}})


def forget(cluster: str) -> None:
    """Drop a deleted cluster's metrics (KEDA must not scale on a number nobody updates)."""
    for role in ROLES:
        series = [(DESIRED, (cluster, role))] + [(DECISIONS, (cluster, role, d)) for d in ("up", "down", "hold")] \
            + [(OBSERVED, (cluster, role, s)) for s in ("ready", "starting", "draining")]
        for metric, labels in series:
            try:
                metric.remove(*labels)
            except KeyError:
                pass
