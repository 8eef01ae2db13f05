"""The kopf handlers: one small function per event, each calling the plain reconcile functions with injected
dependencies. A SplitServeCluster is reconciled when it appears (or the operator restarts), when its spec changes,
every `resync_seconds` (readiness, drift), every `autoscale_seconds` in slo/external mode (the control law's
turn), and when HPA/KEDA scale one of its SplitServeRoles; its status is what
`reconcile` returns. API errors worth retrying become `kopf.TemporaryError` with a delay; an unrealisable spec is a
Degraded condition, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf

from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.kube import KubeError
from splitserve.hosts.k8s.reconcile import Deps, delete_children, reconcile

RETRY_DELAY_S = 10.0


def _retrying(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except KubeError as e:
        if e.transient:
            raise kopf.TemporaryError(f"API server: {e}", delay=RETRY_DELAY_S) from e
        raise kopf.PermanentError(f"API server: {e}") from e


def _write(body: kopf.Body, patch: kopf.Patch, status: dict[str, Any]) -> None:
    """Patch status only where it changed (keys gone from the new status are removed)."""
    old = dict(body.get("status") or {})
    if old != status:
        patch["status"] = {**{k: None for k in old if k not in status}, **status}


def build_registry(deps: Deps, resync_seconds: float, autoscale_seconds: float = 5.0) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    cluster = {"group": names.GROUP, "version": names.VERSION, "plural": names.CLUSTER_PLURAL, "registry": registry}

    @kopf.on.resume(**cluster)
    @kopf.on.create(**cluster)
    @kopf.on.update(**cluster)
    def cluster_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        _write(body, patch, _retrying(lambda: reconcile(body, deps)))

    @kopf.timer(**cluster, interval=resync_seconds, initial_delay=resync_seconds)
    def cluster_resync(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        _write(body, patch, _retrying(lambda: reconcile(body, deps)))

    @kopf.timer(**cluster, interval=autoscale_seconds, initial_delay=autoscale_seconds)
    def cluster_autoscale(body: kopf.Body, spec: kopf.Spec, patch: kopf.Patch, **_: Any) -> None:
        """slo/external: a pass often enough for the control law's interval (it decides at most once per
        autoscaling.intervalSeconds; between decisions the pass changes nothing)."""
        if (spec.get("autoscaling") or {}).get("mode") in ("slo", "external"):
            _write(body, patch, _retrying(lambda: reconcile(body, deps)))

    @kopf.on.delete(**cluster)
    def cluster_deleted(name: str, namespace: str, logger: kopf.Logger, **_: Any) -> None:
        for provider in (deps.desired, deps.registry):
            forget = getattr(provider, "forget", None)
            if forget is not None:
                forget(namespace, name)
        removed = _retrying(lambda: delete_children(deps.kube, namespace, name))
        logger.info("removed %d objects of %s", removed, name)

    @kopf.on.field(names.GROUP, names.VERSION, names.ROLE_PLURAL, field="spec.replicas", registry=registry)
    def role_scaled(old: Any, labels: kopf.Labels, namespace: str, **_: Any) -> None:
        parent = labels.get(names.CLUSTER_LABEL)
        if old is None or parent is None:  # created by the operator itself
            return

        def one_pass() -> None:
            body = deps.kube.get(names.CLUSTER, namespace, parent)
            if body is None or body.get("metadata", {}).get("deletionTimestamp") is not None:
                return
            if (body.get("spec") or {}).get("autoscaling", {}).get("mode") == "external":  # else the operator's own
                status = reconcile(body, deps)
                if status != body.get("status"):
                    deps.kube.patch(names.CLUSTER, namespace, parent, {"status": status}, "status")

        _retrying(one_pass)

    return registry
