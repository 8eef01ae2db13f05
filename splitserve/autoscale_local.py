"""The local actuator of the SLO control law (`splitserve up --autoscale`): every `autoscaling.intervalSeconds`
the shared `Autoscaler` observes the cluster (the bundled Redis registry, the gateways' and workers' /metrics)
and calls the law; this module applies the decision to worker processes on this machine. Scale-up starts
workers; scale-down drains them (SIGTERM: the worker marks itself draining in the registry, finishes its
requests in flight and exits; never SIGKILL). The decision metrics are served on a port of the launcher's own
(`components.autoscaler.metrics`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import start_http_server

from splitserve.autoscaler.actuator import Autoscaler, default_profile, load_profile
from splitserve.autoscaler.law import ROLES, ScalingDecision
from splitserve.autoscaler.observer import Observer
from splitserve.common.config import ClusterResource
from splitserve.common.proc import free_port

log = logging.getLogger("splitserve.autoscaler.local")


class Launcher(Protocol):
    """What the actuator needs of the launcher that owns the processes (`splitserve.launcher.Launcher`)."""

    resource: ClusterResource
    host: str
    components: dict[str, Any]

    def workers(self, role: str) -> list[str]: ...  # names of the role's running, not draining, workers
    def add_worker(self, role: str) -> str: ...
    def drain_worker(self, name: str) -> None: ...


class LocalAutoscaler:
    def __init__(self, launcher: Launcher, autoscaler: Autoscaler, observer: Observer) -> None:
        self.launcher = launcher
        self.autoscaler = autoscaler
        self.observer = observer

    @classmethod
    def for_launcher(cls, launcher: Launcher, profile: str | Path | None = None) -> LocalAutoscaler:
        """The law for the launcher's cluster, its metrics served on a free port (listed in its components)."""
        resource = launcher.resource
        spec = resource.spec
        path = Path(profile) if profile else default_profile(spec)
        replica_profile = load_profile(path)  # ValueError: one line, the launcher stops
        routers = launcher.components["routers"]
        observer = Observer(spec.redis.resolved_url(), spec.model.served_name,
                            lambda: [r["url"] for r in routers], colocated=spec.mode == "colocated")
        scaler = Autoscaler(resource.metadata.name, spec, observer, replica_profile)
        port = free_port(launcher.host)
        start_http_server(port, addr=launcher.host)
        launcher.components["autoscaler"] = {"metrics": f"http://{launcher.host}:{port}", "profile": str(path)}
        log.info("autoscaler on: every %g s, profile %s, metrics http://%s:%d/metrics",
                 spec.autoscaling.interval_seconds, path, launcher.host, port)
        return cls(launcher, scaler, observer)

    def expected(self) -> dict[str, int]:
        """Worker processes asked for per pool (running, not draining)."""
        return {role: len(self.launcher.workers(role)) for role in ROLES}

    def tick(self) -> ScalingDecision | None:
        """Observe, decide and apply when an interval has passed. A failure here is logged and the cluster keeps
        serving with the replicas it has (the autoscaler must never take the cluster down)."""
        try:
            decision = self.autoscaler.tick(self.expected())
            if decision is not None:
                self.apply(decision)
            return decision
        except Exception:
            log.exception("autoscaler: this interval's decision failed; replicas unchanged")
            return None

    def apply(self, decision: ScalingDecision) -> None:
        """Start or drain workers until each pool has the decided number of processes."""
        for role in ROLES:
            running = self.launcher.workers(role)
            want = getattr(decision, role).desired
            for _ in range(want - len(running)):
                name = self.launcher.add_worker(role)
                log.info("autoscaler: started %s", name, extra={"fields": {"role": role, "worker": name}})
            for name in self._drain_order(running)[:max(0, len(running) - want)]:
                self.launcher.drain_worker(name)
                log.info("autoscaler: draining %s", name, extra={"fields": {"role": role, "worker": name}})

    def _drain_order(self, names: list[str]) -> list[str]:
        """Which workers to drain first: those not serving yet (nothing in flight), then the least loaded, then
        the newest."""
        entries = self.observer.entries

        def key(item: tuple[int, str]) -> tuple[int, int, int]:
            index, name = item
            e = entries.get(name)
            if e is None:
                return (0, 0, -index)
            return (1, e.num_running + e.num_waiting, -index)

        return [name for _, name in sorted(enumerate(names), key=key)]

    def close(self) -> None:
        self.observer.close()
