"""Pod templates: a worker of a role, the gateway, the bundled Redis. Commands are the CLI's own
(`splitserve worker --config ... --role ...`, `splitserve router --config ...`), reading the rendered config from
the ConfigMap; the embedded model is fetched by an init container into a per-pod cache both the worker and the
torch-free gateway read.
"""

from __future__ import annotations

import math
from typing import Any

from splitserve.autoscaler.operator import names
from splitserve.common.config import ClusterResource, RoleSpec
from splitserve.common.model_files import EMBEDDED

WORKER_PORT_NAMES = ("grpc", "metrics")


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _common_env(resource: ClusterResource) -> list[dict[str, Any]]:
    env = [{"name": "SPLITSERVE_CACHE", "value": names.CACHE_DIR}]
    secret = resource.spec.redis.url_secret
    if resource.spec.redis.mode == "external" and secret is not None:
        env.append(_secret_env("SPLITSERVE_REDIS_URL", secret.name, secret.key))
    return env


def _volumes(resource: ClusterResource) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) every splitserve pod has: the rendered config, the model cache, the model volume."""
    k8s = resource.spec.kubernetes
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.config_map_name(resource.metadata.name)}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts = [{"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True},
              {"name": "cache", "mountPath": names.CACHE_DIR}]
    if k8s.model_volume:
        volumes.append({"name": "model", **k8s.model_volume})
        mounts.append({"name": "model", "mountPath": k8s.model_mount_path, "readOnly": True})
    return volumes, mounts


def _fetch_models(resource: ClusterResource, mounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Init containers that put the embedded model (and tokenizer) into the pod's cache."""
    model = resource.spec.model
    wanted = [n for n in dict.fromkeys([model.name, model.tokenizer]) if n in EMBEDDED]
    images = resource.spec.images
    return [{"name": f"fetch-{n}", "image": images.worker, "imagePullPolicy": images.pull_policy,
             "command": ["splitserve", "fetch-model", n], "env": _common_env(resource),
             "volumeMounts": [dict(m) for m in mounts if m["name"] == "cache"]} for n in wanted]


def _http_probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


def worker_command(role: str) -> list[str]:
    """A worker's command line (POD_NAME and POD_IP come from the downward API)."""
    return ["splitserve", "worker", "--config", names.CONFIG_PATH, "--role", role, "--host", "0.0.0.0",
            "--name", "$(POD_NAME)", "--advertise-host", "$(POD_IP)"]


def gateway_command() -> list[str]:
    return ["splitserve", "router", "--config", names.CONFIG_PATH, "--host", "0.0.0.0"]


def worker_pod(resource: ClusterResource, component: str, role: str, spec: RoleSpec,
               pod_labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    """The pod template of one worker role (`role`: prefill, decode or both)."""
    k8s, images = resource.spec.kubernetes, resource.spec.images
    volumes, mounts = _volumes(resource)
    if k8s.shm_size:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    env = [_field_env("POD_NAME", "metadata.name"), _field_env("POD_IP", "status.podIP"),
           _field_env("POD_NAMESPACE", "metadata.namespace"), *_common_env(resource)]
    container = {
        "name": "worker",
        "image": images.worker,
        "imagePullPolicy": images.pull_policy,
        "command": worker_command(role),
        "env": env,
        "ports": [{"name": "grpc", "containerPort": spec.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": spec.metrics_port, "protocol": "TCP"}],
        # /healthz answers while the model loads; /readyz only once the role's service is built.
        "startupProbe": _http_probe("/healthz", "metrics", 10, 30),
        "livenessProbe": _http_probe("/healthz", "metrics", 10, 3),
        "readinessProbe": _http_probe("/readyz", "metrics", 5, 2),
        "resources": spec.resources,
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    pod: dict[str, Any] = {
        # SIGTERM starts the drain (the worker leaves the registry, finishes what is in flight, exits).
        "terminationGracePeriodSeconds": math.ceil(spec.drain_seconds) + names.DRAIN_MARGIN_SECONDS,
        "initContainers": _fetch_models(resource, mounts),
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": spec.node_selector,
        "tolerations": spec.tolerations,
        "affinity": spec.affinity,
        "hostIPC": k8s.host_ipc,
        "enableServiceLinks": False,
    }
    return {"metadata": {"labels": pod_labels, "annotations": annotations},
            "spec": {k: v for k, v in pod.items() if v not in ({}, [], None)}}


def gateway_pod(resource: ClusterResource, pod_labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    spec, images = resource.spec, resource.spec.images
    volumes, mounts = _volumes(resource)
    env = _common_env(resource)
    if spec.router.api_key_secret is not None:
        env.append(_secret_env("SPLITSERVE_API_KEYS", spec.router.api_key_secret.name, spec.router.api_key_secret.key))
    container = {
        "name": "gateway",
        "image": images.gateway,
        "imagePullPolicy": images.pull_policy,
        "command": gateway_command(),
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.router.port, "protocol": "TCP"}],
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        # /health is 503 while no decode worker is healthy: such a gateway takes no traffic.
        "readinessProbe": _http_probe("/health", "http", 5, 2),
        "resources": spec.router.resources,
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    pod: dict[str, Any] = {"initContainers": _fetch_models(resource, mounts), "containers": [container],
                           "volumes": volumes, "enableServiceLinks": False}
    return {"metadata": {"labels": pod_labels, "annotations": annotations},
            "spec": {k: v for k, v in pod.items() if v not in ({}, [], None)}}


def redis_pod(resource: ClusterResource, pod_labels: dict[str, str]) -> dict[str, Any]:
    """The bundled Redis: soft state only (registry, KV index, KV pool), so no persistence."""
    images = resource.spec.images
    container = {
        "name": "redis",
        "image": images.redis,
        "imagePullPolicy": images.pull_policy,
        "args": ["--save", "", "--appendonly", "no"],
        "ports": [{"name": "redis", "containerPort": names.REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "runAsUser": 999},
    }
    return {"metadata": {"labels": pod_labels}, "spec": {"containers": [container], "enableServiceLinks": False}}
