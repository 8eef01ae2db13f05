"""Running the operator: kopf's settings (progress and diff-base in annotations, so the status schema stays the
CRD's; a splitserve finalizer; no CRD or namespace scanning, so RBAC stays small; standalone, one replica), the
API login and the event loop. `splitserve operator` calls `run`; tests call `operate` against an emulator.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection
from typing import Any

import kopf

from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.flips import RegistryReader
from splitserve.hosts.k8s.handlers import build_registry
from splitserve.hosts.k8s.kube import Kube
from splitserve.hosts.k8s.reconcile import Deps
from splitserve.hosts.k8s.slo import SloReplicas

Login = Callable[..., kopf.ConnectionInfo | None]


def settings() -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    s.persistence.finalizer = names.FINALIZER
    s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=names.GROUP)
    s.scanning.disabled = True  # no watching CRDs or namespaces: the RBAC lists only what the operator touches
    s.posting.reporting_component = names.FIELD_MANAGER
    s.peering.standalone = True
    s.watching.server_timeout = 300
    return s


async def operate(deps: Deps, login: Login, *, namespaces: Collection[str] = (), clusterwide: bool = False,
                  resync_seconds: float = 30.0, stop_flag: asyncio.Event | threading.Event | None = None,
                  ready_flag: asyncio.Event | threading.Event | None = None, health_port: int = 0,
                  autoscale_seconds: float = 5.0) -> None:
    """Run until `stop_flag` is set: handlers from `build_registry(deps)`, credentials from `login`; with
    `health_port`, kopf answers liveness probes on http://0.0.0.0:PORT/healthz."""
    registry = build_registry(deps, resync_seconds, autoscale_seconds)
    kopf.on.login(registry=registry)(login)
    await kopf.operator(registry=registry, settings=settings(), standalone=True, clusterwide=clusterwide,
                        namespaces=list(namespaces), stop_flag=stop_flag, ready_flag=ready_flag,
                        liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz" if health_port else None)


def run(namespaces: Collection[str], clusterwide: bool, resync_seconds: float, health_port: int = 0,
        metrics_port: int = 0) -> None:
    """The operator in this process, with the pod's service account (or the kubeconfig); the SLO control law
    for clusters in slo/external mode, and each cluster's registry read for its role flips; with `metrics_port`, Prometheus metrics (the autoscaler's desired
    replicas, which KEDA/HPA read in external mode) on http://0.0.0.0:PORT/metrics."""
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port)

    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    deps = Deps(Kube.from_environment(), SloReplicas(), registry=RegistryReader())
    asyncio.run(operate(deps, login, namespaces=namespaces, clusterwide=clusterwide, resync_seconds=resync_seconds,
                        health_port=health_port))
