"""Everything a SplitServeCluster owns, rendered as plain Kubernetes objects from the resource and the replica
decision: the ConfigMap with the rendered config, the gateway and per-role Deployments, their Services and
PodDisruptionBudgets, one SplitServeRole per worker role, and the bundled Redis. Pure functions: no API calls.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from splitserve.common.config import ClusterResource, Metadata
from splitserve.common.config_file import dump
from splitserve.hosts.common import worker_pools
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.checks import check
from splitserve.hosts.k8s.pods import gateway_pod, redis_pod, worker_pod
from splitserve.hosts.k8s.replicas import Observed, ReplicaDecision, decide, spec_or_scale

# Fields that change without a restart (the operator acts on them), left out of the pods' config hash.
_NO_RESTART_ROLE_KEYS = ("replicas", "minReplicas", "maxReplicas")
_NO_RESTART_SPEC_KEYS = ("ratio", "autoscaling")


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {"apiVersion": body.get("apiVersion", names.CLUSTER.api_version), "kind": names.CLUSTER.kind,
            "name": meta["name"], "uid": meta.get("uid"), "controller": True, "blockOwnerDeletion": True}


def rendered(resource: ClusterResource, decision: ReplicaDecision) -> ClusterResource:
    """The document every pod reads: the decided replicas, the bundled Redis's URL, and (with no Redis registry)
    the worker Services as static membership."""
    out = resource.model_copy(deep=True)
    meta = resource.metadata
    out.metadata = Metadata(name=meta.name, namespace=meta.namespace, labels=meta.labels)
    out.status = None
    spec = out.spec
    spec.decode.replicas = decision.decode
    if spec.mode == "disaggregated" and decision.prefill >= 1:  # the model needs one; 0 (scaled to zero) keeps it
        spec.prefill.replicas = decision.prefill
    if spec.redis.mode == "bundled":
        spec.redis.url = names.redis_url(meta.name)  # mode stays bundled: the operator runs it
    elif spec.redis.mode == "none" and not (spec.membership.prefill or spec.membership.decode):
        # No registry: each pool is reached through its Service (kube-proxy spreads connections).
        if spec.mode == "disaggregated":
            spec.membership.prefill = [f"{names.child_name(meta.name, names.PREFILL)}:{spec.prefill.port}"]
        spec.membership.decode = [f"{names.child_name(meta.name, names.DECODE)}:{spec.decode.port}"]
    return out


def config_hash(document: str) -> str:
    """A hash of what the pods read at start: changes roll the pods; replica counts and bounds do not."""
    data = yaml.safe_load(document)
    spec = data.get("spec", {})
    for key in _NO_RESTART_SPEC_KEYS:
        spec.pop(key, None)
    for role in ("prefill", "decode"):
        for key in _NO_RESTART_ROLE_KEYS:
            spec.get(role, {}).pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class Renderer:
    """Renders one cluster's children; each method returns one object."""

    def __init__(self, resource: ClusterResource, decision: ReplicaDecision, owner: dict[str, Any],
                 groups: dict[str, int] | None = None) -> None:
        self.resource = resource
        self.decision = decision
        self.owner = owner
        self.groups = groups or {}  # component -> its Deployment's pods, where role flips make it differ
        self.name = resource.metadata.name
        self.namespace = resource.metadata.namespace or "default"
        self.document = dump(rendered(resource, decision))
        self.annotations = {names.CONFIG_HASH_ANNOTATION: config_hash(self.document)}

    def _meta(self, name: str, component: str | None) -> dict[str, Any]:
        return {"name": name, "namespace": self.namespace,
                "labels": names.labels(self.name, component, self.resource.metadata.labels),
                "ownerReferences": [self.owner]}

    def _object(self, kind: names.Kind, name: str, component: str | None, **body: Any) -> dict[str, Any]:
        return {"apiVersion": kind.api_version, "kind": kind.kind, "metadata": self._meta(name, component), **body}

    def config_map(self) -> dict[str, Any]:
        return self._object(names.CONFIGMAP, names.config_map_name(self.name), None,
                            data={names.CONFIG_FILE: self.document})

    def deployment(self, component: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
        return self._object(names.DEPLOYMENT, names.child_name(self.name, component), component, spec={
            "replicas": replicas, "revisionHistoryLimit": 3,
            "selector": {"matchLabels": names.selector(self.name, component)}, "template": template})

    def service(self, component: str, ports: list[tuple[str, int]], type_: str = "ClusterIP") -> dict[str, Any]:
        return self._object(names.SERVICE, names.child_name(self.name, component), component, spec={
            "type": type_, "selector": names.selector(self.name, component),
            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports]})

    def pdb(self, component: str) -> dict[str, Any]:
        # One pod at a time: drains proceed, and a worker's requests finish before the next one goes.
        return self._object(names.PDB, names.child_name(self.name, component), component, spec={
            "maxUnavailable": 1, "selector": {"matchLabels": names.selector(self.name, component)}})

    def role(self, component: str, replicas: int) -> dict[str, Any]:
        return self._object(names.ROLE, names.child_name(self.name, component), component,
                            spec={"replicas": replicas})

    def pod_labels(self, component: str) -> dict[str, str]:
        return names.labels(self.name, component, self.resource.metadata.labels)

    def gateway(self) -> list[dict[str, Any]]:
        router = self.resource.spec.router
        template = gateway_pod(self.resource, self.pod_labels(names.GATEWAY), self.annotations)
        return [self.deployment(names.GATEWAY, router.replicas, template),
                self.service(names.GATEWAY, [("http", router.port)], self.resource.spec.kubernetes.gateway_service_type),
                self.pdb(names.GATEWAY)]

    def workers(self, component: str, role: str) -> list[dict[str, Any]]:
        spec = self.resource.spec.role(component)
        replicas = self.decision.prefill if component == names.PREFILL else self.decision.decode
        template = worker_pod(self.resource, component, role, spec, self.pod_labels(component), self.annotations)
        return [self.deployment(component, self.groups.get(component, replicas), template),
                self.service(component, [("grpc", spec.port), ("metrics", spec.metrics_port)]),
                self.pdb(component), self.role(component, replicas)]

    def redis(self) -> list[dict[str, Any]]:
        name = names.child_name(self.name, names.REDIS)
        statefulset = self._object(names.STATEFULSET, name, names.REDIS, spec={
            "replicas": 1, "serviceName": name, "selector": {"matchLabels": names.selector(self.name, names.REDIS)},
            "template": redis_pod(self.resource, self.pod_labels(names.REDIS))})
        return [statefulset, self.service(names.REDIS, [("redis", names.REDIS_PORT)])]

    def all(self) -> list[dict[str, Any]]:
        out = [self.config_map()]
        if self.resource.spec.redis.mode == "bundled":
            out += self.redis()
        for component, role in worker_pools(self.resource.spec):  # a pool's component is named after it
            out += self.workers(component, role)
        return out + self.gateway()


def children(resource: ClusterResource, decision: ReplicaDecision, owner: dict[str, Any],
             groups: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Every object the cluster should own, in the order to apply them. `groups`: the worker Deployments' pods
    where role flips make them differ from the decision's serving replicas (which the SplitServeRoles keep)."""
    return Renderer(resource, decision, owner, groups).all()


def preview(resource: ClusterResource, uid: str | None = None) -> list[dict[str, Any]]:
    """What the operator's first pass over `resource` creates (`splitserve render`): the same checks, replica
    decision (the spec's replicas, before any autoscaler or HPA has written one) and builders. Objects are owned
    by the cluster only when its `uid` is known (the API server assigns it). Raises Unrealisable."""
    check(resource)
    decision = decide(resource.spec, spec_or_scale(resource.spec, Observed()))
    meta = resource.metadata
    body = {"apiVersion": resource.api_version, "metadata": {"name": meta.name, "uid": uid}}
    objects = children(resource, decision, owner_reference(body))
    if uid is None:
        for obj in objects:
            del obj["metadata"]["ownerReferences"]
    return objects
