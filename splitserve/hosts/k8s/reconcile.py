"""One reconcile pass of one SplitServeCluster, as plain functions of the resource's body and injected
dependencies: read what exists, decide replicas, apply the decision's role flip (`flips`), render the children,
apply them, prune what is no longer wanted, and return the new status as a dict. Idempotent: a pass over a converged cluster writes nothing new, so
the operator can restart or run a pass twice at any point.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from splitserve.common.config import ClusterResource
from splitserve.common.config_file import ConfigError, parse_resource
from splitserve.hosts.common import Placement, flip_workers, worker_pools
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.checks import check
from splitserve.hosts.k8s.children import children, owner_reference
from splitserve.hosts.k8s.flips import Flipper, Registry, apply_flip, placement
from splitserve.hosts.k8s.kube import Kube
from splitserve.hosts.k8s.replicas import (
    DesiredReplicas,
    Observed,
    ReplicaDecision,
    Unrealisable,
    decide,
    spec_or_scale,
)
from splitserve.hosts.k8s.status import (
    ClusterStatus,
    Decision,
    Replicas,
    RoleStatus,
    dump,
    now,
    set_condition,
)

COMPONENTS = (names.GATEWAY, names.PREFILL, names.DECODE)


@dataclass(frozen=True)
class Deps:
    """What the handlers need, injected: the API client, the replica provider (the control law's seam), the
    clusters' registries (which pods serve which role; None: not read) and how pods are flipped."""

    kube: Kube
    desired: DesiredReplicas = spec_or_scale
    registry: Registry | None = None
    flipper: Flipper = flip_workers


def resource_of(body: Mapping[str, Any]) -> ClusterResource:
    """The validated document of a SplitServeCluster's body (what kubectl wrote, less server metadata); a spec
    the API server accepted but the model refuses is Unrealisable (InvalidSpec)."""
    doc = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    meta = doc.get("metadata", {})
    doc["metadata"] = {k: meta[k] for k in ("name", "namespace", "labels") if meta.get(k) is not None}
    try:
        return parse_resource(doc, "spec")
    except ConfigError as e:
        raise Unrealisable("InvalidSpec", str(e).removeprefix("spec: ")) from None


Current = dict[tuple[str, str], dict[str, Any]]  # (kind, name) -> the live object


def _current(kube: Kube, namespace: str, name: str) -> Current:
    """Everything the cluster owns now: one list per kind."""
    match = {names.CLUSTER_LABEL: name, "app.kubernetes.io/managed-by": names.MANAGED_BY}
    return {(kind.kind, o["metadata"]["name"]): o for kind in names.OWNED for o in kube.list(kind, namespace, match)}


def _observe(current: Current, name: str, namespace: str) -> Observed:
    """The SplitServeRoles' replicas and the ready pods, as the replica provider sees them."""
    roles, ready = {}, {}
    for component in COMPONENTS:
        child = names.child_name(name, component)
        deployment = current.get((names.DEPLOYMENT.kind, child))
        if deployment is not None:
            ready[component] = (deployment.get("status") or {}).get("readyReplicas", 0)
        role = current.get((names.ROLE.kind, child))
        if role is not None and isinstance((role.get("spec") or {}).get("replicas"), int):
            roles[component] = role["spec"]["replicas"]
    return Observed(role_replicas=roles, ready=ready, cluster=name, namespace=namespace)


def contains(live: Any, wanted: Any) -> bool:
    """Whether `live` already has every field of `wanted` (the server adds defaults; quantities may come back as
    strings), so applying `wanted` would change nothing."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(contains(live.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(contains, live, wanted))
    return live == wanted or (live is not None and not isinstance(wanted, bool) and str(live) == str(wanted))


def _stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with a hash of itself in an annotation: the next pass skips it while the live object still has that
    hash and every field it sets (so a field the operator stops setting, or one someone else changed, re-applies)."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    meta = obj["metadata"]
    return {**obj, "metadata": {**meta, "annotations": {**meta.get("annotations", {}),
                                                        names.APPLIED_HASH_ANNOTATION: digest}}}


def _apply_role(kube: Kube, obj: dict[str, Any], live: dict[str, Any] | None, external: bool) -> None:
    """SplitServeRoles: created with the decided replicas; afterwards their spec.replicas belongs to whoever
    scales them in external mode (HPA/KEDA), and is set to the decision otherwise."""
    meta = obj["metadata"]
    if live is None:
        kube.create(obj)
        return
    patch: dict[str, Any] = {}
    if not contains(live.get("metadata"), {"labels": meta["labels"], "ownerReferences": meta["ownerReferences"]}):
        patch["metadata"] = {"labels": meta["labels"], "ownerReferences": meta["ownerReferences"]}
    if not external and (live.get("spec") or {}).get("replicas") != obj["spec"]["replicas"]:
        patch["spec"] = {"replicas": obj["spec"]["replicas"]}
    if patch:
        kube.patch(names.ROLE, meta["namespace"], meta["name"], patch)


def _prune(kube: Kube, namespace: str, uid: str | None, current: Current, keep: set[tuple[str, str]]) -> None:
    """Delete what this cluster owns but no longer wants (a role after a mode change, Redis gone external)."""
    order = {kind.kind: i for i, kind in enumerate(names.OWNED)}
    for key in sorted(set(current) - keep, key=lambda k: -order[k[0]]):  # dependents first, the ConfigMap last
        owners = {o.get("uid") for o in current[key]["metadata"].get("ownerReferences") or []}
        if uid is None or uid in owners:
            kube.delete(names.KINDS[key[0]], namespace, key[1])


def delete_children(kube: Kube, namespace: str, name: str) -> int:
    """Remove everything the cluster owns (owner references do it too; this does not wait for the collector)."""
    current = _current(kube, namespace, name)
    return sum(kube.delete(names.KINDS[kind], namespace, child) for kind, child in current)


def reconcile(body: Mapping[str, Any], deps: Deps) -> dict[str, Any]:
    """One pass over one SplitServeCluster; returns its new status (a dict for status, camelCase keys)."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta.get("namespace") or "default", meta.get("generation")
    old = ClusterStatus.model_validate(body.get("status") or {})
    try:
        resource = resource_of(body)
        check(resource)
        current = _current(deps.kube, namespace, name)
        observed = replace(_observe(current, name, namespace), law_state=(body.get("status") or {}).get("lawState"))
        decision = decide(resource.spec, deps.desired(resource.spec, observed))
    except Unrealisable as e:
        return _degraded(old, e, generation)
    external = resource.spec.autoscaling.mode == "external"
    where = _placement(deps, resource, decision, namespace)
    groups = None if where is None else {c: where.group_size(c, getattr(decision, c)) for c in (names.PREFILL,
                                                                                                 names.DECODE)}
    objects = children(resource, decision, owner_reference(dict(body)), groups)
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        if obj["kind"] == names.ROLE.kind:
            _apply_role(deps.kube, obj, current.get(key), external)
        else:
            stamped = _stamped(obj)
            if key not in current or not contains(current[key], stamped):
                deps.kube.apply(stamped)
    _prune(deps.kube, namespace, meta.get("uid"), current, {(o["kind"], o["metadata"]["name"]) for o in objects})
    _report_roles(deps.kube, resource, current, where)
    return _healthy(old, resource, decision, current, generation, where)


def _placement(deps: Deps, resource: ClusterResource, decision: ReplicaDecision, namespace: str) -> Placement | None:
    """Which pods serve which role, from the registry, after the decision's role flip; None where nothing can
    have flipped (colocated, no registry, Redis not answering)."""
    spec, name = resource.spec, resource.metadata.name
    if deps.registry is None or spec.mode != "disaggregated":
        return None
    entries = deps.registry(namespace, name, spec)
    if entries is None:
        return None
    where = placement(name, entries)
    if decision.flip is not None:
        where = apply_flip(deps.kube, namespace, name, decision.flip, entries, where, deps.flipper)
    return where


def _serving(where: Placement | None, component: str, in_deployment: int) -> int:
    """A role's pods counted where they serve: its Deployment's, less those flipped out, plus those flipped in."""
    if where is None:
        return in_deployment
    return max(0, in_deployment - len(where.flipped_out(component)) + len(where.flipped_in.get(component, [])))


def _deployment_status(current: Current, name: str, component: str) -> dict[str, Any]:
    return (current.get((names.DEPLOYMENT.kind, names.child_name(name, component))) or {}).get("status") or {}


def _report_roles(kube: Kube, resource: ClusterResource, current: Current, where: Placement | None) -> None:
    """The scale subresource's view: pods that serve the role, the selector HPA counts them with, and (with a
    registry) which pods those are."""
    name, namespace = resource.metadata.name, resource.metadata.namespace or "default"
    for component, _ in worker_pools(resource.spec):
        dstatus = _deployment_status(current, name, component)
        pods = {} if where is None else {"serving_pods": where.serving.get(component, []),
                                         "flipped_pods": where.flipped_in.get(component, [])}
        status = dump(RoleStatus(replicas=_serving(where, component, dstatus.get("replicas", 0)),
                                 ready_replicas=_serving(where, component, dstatus.get("readyReplicas", 0)),
                                 selector=names.selector_string(name, component), **pods))
        role = current.get((names.ROLE.kind, names.child_name(name, component)))
        if role is not None and role.get("status") != status:  # a role created in this pass: the next one
            kube.patch(names.ROLE, namespace, names.child_name(name, component), {"status": status}, "status")


def _healthy(old: ClusterStatus, resource: ClusterResource, decision: ReplicaDecision, current: Current,
             generation: int | None, where: Placement | None = None) -> dict[str, Any]:
    spec, name = resource.spec, resource.metadata.name
    desired = Replicas(prefill=decision.prefill, decode=decision.decode, gateway=spec.router.replicas)
    ready = Replicas(**{c: _serving(where, c, _deployment_status(current, name, c).get("readyReplicas", 0))
                        if c != names.GATEWAY else _deployment_status(current, name, c).get("readyReplicas", 0)
                        for c in COMPONENTS})
    if spec.mode == "colocated":
        ready.prefill = 0
    last = old.last_decision
    if last is None or (last.prefill, last.decode, last.reason) != (decision.prefill, decision.decode, decision.reason):
        last = Decision(prefill=decision.prefill, decode=decision.decode, reason=decision.reason, time=now())
    short = [f"{c} {getattr(ready, c)}/{getattr(desired, c)}" for c in COMPONENTS
             if getattr(ready, c) < getattr(desired, c)]
    all_ready = not short
    conditions = set_condition(old.conditions, "Ready", all_ready, "AllReplicasReady" if all_ready else "ReplicasNotReady",
                               "every component has its desired replicas ready" if all_ready
                               else "waiting for " + ", ".join(short) + " ready", generation)
    conditions = set_condition(conditions, "Progressing", not all_ready, "RollingOut" if not all_ready else "Stable",
                               "applied; pods are starting or rolling" if not all_ready else "nothing in flight",
                               generation)
    no_registry = spec.redis.mode == "none"
    conditions = set_condition(conditions, "Degraded", False, "AsExpected",
                               "no Redis: workers are reached through their Services (no KV-aware routing)"
                               if no_registry else "", generation)
    status = ClusterStatus(
        observed_generation=generation, model=spec.model.served_name,
        prefill=f"{ready.prefill}/{desired.prefill}", decode=f"{ready.decode}/{desired.decode}",
        ratio=round(decision.prefill / decision.decode, 4) if spec.mode == "disaggregated" else None,
        ready_replicas=ready, desired_replicas=desired, last_decision=last, conditions=conditions,
        law_state=decision.law_state)
    return dump(status)


def _degraded(old: ClusterStatus, problem: Unrealisable, generation: int | None) -> dict[str, Any]:
    """Nothing applied: say why, keep what the last good pass reported."""
    conditions = set_condition(old.conditions, "Degraded", True, problem.reason, problem.message, generation)
    conditions = set_condition(conditions, "Progressing", False, "Blocked", "the spec cannot be realised; "
                               "nothing was changed (see Degraded)", generation)
    if not any(c.type == "Ready" for c in conditions):
        conditions = set_condition(conditions, "Ready", False, "Degraded", "nothing is running yet", generation)
    status = old.model_copy(update={"observed_generation": generation, "conditions": conditions})
    return dump(status)
