"""The Kubernetes actuator of the SLO control law: a `DesiredReplicas` provider (`Deps.desired`) that runs the
shared `Autoscaler` for each cluster in `slo` and `external` mode.

- slo: every `autoscaling.intervalSeconds` the law decides from an observation of the cluster (its Redis
  registry and the gateway's /metrics, reached through their Services); the decision is what the reconcile pass
  applies to the SplitServeRoles and Deployments (clamped again by the bounds), its role flip first (`flips`),
  and writes to `status.lastDecision` with its reason. Between decisions the last one holds.
- external: the same law runs, but only exports `splitserve_autoscaler_desired_replicas{cluster,role}` for
  KEDA/HPA, which scale the SplitServeRoles' scale subresource; the operator applies what they write.
- manual: the spec's replicas.

The law's memory (`ControllerState`) goes back with every answer (`Wanted.law_state`), the reconcile pass keeps
it in the cluster's `status.lawState`, and a provider that has no `Autoscaler` for a cluster yet (a restarted
operator) starts one from it: cooldowns, the forecast's history and the learned corrections carry over. Its
clock is wall time, so the state's times mean the same in the next process.

Observation sources are injected (`observers`), so tests give a real Redis and a metrics server of their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from splitserve.autoscaler.actuator import Autoscaler, default_profile, forget, load_profile
from splitserve.autoscaler.law_state import ControllerState
from splitserve.autoscaler.observations import Observation
from splitserve.autoscaler.observer import Observer
from splitserve.autoscaler.profile import ReplicaProfile
from splitserve.common.config import ClusterSpec
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.flips import cluster_redis_url
from splitserve.hosts.k8s.replicas import Observed, Unrealisable, Wanted, spec_or_scale

log = logging.getLogger("splitserve.operator.slo")
ObserverFactory = Callable[[str, str, ClusterSpec], Observer | Callable[..., Observation]]


def service_observer(namespace: str, cluster: str, spec: ClusterSpec) -> Observer:
    """The cluster as the operator reaches it: the bundled Redis's Service (or the external URL) and the
    gateway's Service. With several gateway replicas behind it each scrape reaches one of them, so the rates are
    one gateway's share (the registry's queue depths are whole)."""
    gateway = f"http://{names.child_name(cluster, names.GATEWAY)}.{namespace}.svc:{spec.router.port}"
    return Observer(cluster_redis_url(namespace, cluster, spec), spec.model.served_name, [gateway],
                    colocated=spec.mode == "colocated")


class SloReplicas:
    """`Deps.desired` for the SLO law; one `Autoscaler` (and its state) per cluster, kept in memory."""

    def __init__(self, observers: ObserverFactory = service_observer,
                 profile: Callable[[ClusterSpec], ReplicaProfile] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.observers = observers
        self.clock = clock  # wall time: the state's times outlive this process (status.lawState)
        self.profile = profile or self._default_profile
        self._scalers: dict[tuple[str, str], Autoscaler] = {}
        self._applied: dict[tuple[str, str], Wanted] = {}
        self._lock = threading.Lock()  # kopf runs sync handlers in threads

    @staticmethod
    def _default_profile(spec: ClusterSpec) -> ReplicaProfile:
        path: Path = default_profile(spec, gpu=spec.model.device != "cpu")
        try:
            return load_profile(path)
        except ValueError as e:
            raise Unrealisable("NoReplicaProfile", f"autoscaling.mode slo needs a replica profile: {e}") from None

    def __call__(self, spec: ClusterSpec, observed: Observed) -> Wanted:
        mode = spec.autoscaling.mode
        key = (observed.namespace, observed.cluster)
        if mode == "manual" or not observed.cluster:
            self.forget(*key)
            return spec_or_scale(spec, observed)
        with self._lock:
            scaler = self._scalers.get(key)
            if scaler is None:
                scaler = Autoscaler(observed.cluster, spec, self.observers(*key, spec), self.profile(spec),
                                    clock=self.clock, state=self._restored(key, observed))
                self._scalers[key] = scaler
            elif scaler.spec != spec:
                scaler.configure(spec)
            fallback = spec_or_scale(spec, observed)
            current = {"prefill": observed.role_replicas.get("prefill", spec.prefill.replicas),
                       "decode": observed.role_replicas.get("decode", spec.decode.replicas)}
            decision = scaler.tick(current)
            state = scaler.state.to_json()
            if mode == "external":  # the law's numbers are exported; HPA/KEDA apply them through /scale
                return Wanted(fallback.prefill, fallback.decode, fallback.source, state)
            last = self._applied.get(key)
            if decision is not None and (last is None or decision.changed
                                         or (last.prefill, last.decode) != (decision.prefill.desired,
                                                                           decision.decode.desired)):
                last = Wanted(decision.prefill.desired, decision.decode.desired, f"slo: {decision.reason}")
                self._applied[key] = last
            if last is None:  # no decision yet (the first observation only opens the window)
                return Wanted(current["prefill"], current["decode"], "slo: waiting for the first observation window",
                              state)
            flip = decision.flip if decision is not None else None  # applied once: in the pass that decided it
            return Wanted(last.prefill, last.decode, last.source, state, flip)

    @staticmethod
    def _restored(key: tuple[str, str], observed: Observed) -> ControllerState | None:
        """The state the last operator kept in status.lawState; none (start afresh, said in the log) when there is
        none or it is not one this law reads."""
        if observed.law_state is None:
            return None
        try:
            state = ControllerState.from_json(observed.law_state)
        except ValueError as e:
            log.warning("%s/%s: status.lawState not restored, starting the law afresh: %s", *key, e)
            return None
        log.info("%s/%s: control law state restored from status.lawState", *key)
        return state

    def forget(self, namespace: str, cluster: str) -> None:
        with self._lock:
            scaler = self._scalers.pop((namespace, cluster), None)
            self._applied.pop((namespace, cluster), None)
        if scaler is not None:
            forget(cluster)
            close = getattr(scaler.observe, "__self__", None)
            if isinstance(close, Observer):
                close.close()
