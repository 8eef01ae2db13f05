"""The operator's part of role flips: which pods serve which role (the registry, read through the cluster's Redis
Service), the law's flip applied to the least loaded pods of its source role (their gRPC Flip call; the worker
does the rest), and the Deployments sized for the pods they hold.

A flipped pod stays in its Deployment (its resources, probes and labels are its Deployment's) and serves the
other role; its Deployment holds it on top of its own role's pods, and the other Deployment holds one pod fewer
(`Placement.group_size`). It carries a high pod-deletion cost, so that a scale-down of its Deployment takes a
pod of the Deployment's own role first. A pod whose container restarts comes back in its Deployment's role (its
command line's): the registry says so, and the next pass counts it there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from splitserve.autoscaler.flips import RoleFlip
from splitserve.autoscaler.observer import Observer
from splitserve.common.config import ClusterSpec
from splitserve.common.redis_wire import RegistryEntry
from splitserve.hosts.common import Placement, flip_candidates
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.kube import Kube, KubeError

log = logging.getLogger("splitserve.operator.flips")
DELETION_COST = "1000"  # a flipped pod's pod-deletion-cost (the default is 0: its Deployment's own pods go first)

Registry = Callable[[str, str, ClusterSpec], dict[str, RegistryEntry] | None]  # (namespace, cluster, spec)
Flipper = Callable[[Mapping[str, str], str], dict[str, str | None]]  # (name -> endpoint, role) -> name -> problem


def cluster_redis_url(namespace: str, cluster: str, spec: ClusterSpec) -> str | None:
    """The cluster's Redis as the operator reaches it: the bundled one's Service, or the external URL."""
    if spec.redis.mode == "bundled":
        return f"redis://{names.child_name(cluster, names.REDIS)}.{namespace}.svc:{names.REDIS_PORT}/0"
    return spec.redis.resolved_url()


def pool_of(cluster: str) -> Callable[[str], str | None]:
    """A worker's Deployment (prefill or decode) from its registry name, its pod's name."""
    prefixes = {names.child_name(cluster, c) + "-": c for c in (names.PREFILL, names.DECODE)}

    def pool(name: str) -> str | None:
        return next((c for prefix, c in prefixes.items() if name.startswith(prefix)), None)

    return pool


class RegistryReader:
    """`Deps.registry`: each cluster's registry entries, through a Redis client kept per cluster; None when the
    cluster has no Redis or it did not answer (the pass then sizes Deployments as if nothing had flipped)."""

    def __init__(self) -> None:
        self._observers: dict[tuple[str, str], Observer] = {}

    def __call__(self, namespace: str, cluster: str, spec: ClusterSpec) -> dict[str, RegistryEntry] | None:
        url = cluster_redis_url(namespace, cluster, spec)
        if url is None:
            return None
        observer = self._observers.get((namespace, cluster))
        if observer is None or observer.redis_url != url or observer.model != spec.model.served_name:
            if observer is not None:
                observer.close()
            observer = self._observers[(namespace, cluster)] = Observer(url, spec.model.served_name, [])
        return observer.registry()

    def forget(self, namespace: str, cluster: str) -> None:
        observer = self._observers.pop((namespace, cluster), None)
        if observer is not None:
            observer.close()


def placement(cluster: str, entries: Mapping[str, RegistryEntry]) -> Placement:
    return Placement.of(entries.values(), pool_of(cluster))


def apply_flip(kube: Kube, namespace: str, cluster: str, flip: RoleFlip, entries: Mapping[str, RegistryEntry],
               where: Placement, flipper: Flipper) -> Placement:
    """Flip the least loaded pods serving `flip.source` (this cluster's, up to `flip.workers`) and mark each with
    its deletion cost (a high one while it serves the other Deployment's role, none once back); the placement
    after. A pod that did not flip is logged and stays where it is (the Deployments are sized for what is)."""
    pool = pool_of(cluster)
    ours = [e for e in entries.values() if pool(e.name) is not None]
    chosen = flip_candidates(ours, flip.source)[:flip.workers]
    results = flipper({n: entries[n].endpoint for n in chosen}, flip.target)
    done = [n for n, problem in results.items() if problem is None]
    for name, problem in results.items():
        if problem is not None:
            log.warning("%s/%s: pod %s did not flip to %s: %s", namespace, cluster, name, flip.target, problem)
            continue
        log.info("%s/%s: pod %s serves %s (flipped from %s: %s)", namespace, cluster, name, flip.target, flip.source,
                 flip.reason)
        cost = None if pool(name) == flip.target else DELETION_COST
        try:
            kube.patch(names.POD, namespace, name, {"metadata": {"annotations": {names.DELETION_COST_ANNOTATION: cost}}})
        except KubeError as e:
            if e.status != 404:  # gone meanwhile: nothing to mark
                raise
    return where.moved(done, flip.source, flip.target, pool)
