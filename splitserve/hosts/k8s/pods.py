"""Pod templates: a worker of a role, the gateway, the bundled Redis. Commands are the CLI's own
(`splitserve worker --config ... --role ...`, `splitserve router --config ...`), reading the rendered config from
the ConfigMap. A worker's init container fetches the embedded model into a per-pod cache; the torch-free gateway
reads the embedded model's tokenizer from its own image (baked in at build time), so it never pulls the worker
image.

Every pod meets the `restricted` Pod Security Standard (non-root, seccomp RuntimeDefault, no privilege
escalation, all capabilities dropped) with a read-only root filesystem (emptyDirs for /tmp and the model cache),
and every container, init containers included, has cpu and memory requests and limits, so a namespace's
ResourceQuota admits it. `spec.kubernetes` adds the pod-level settings platform teams set (security contexts,
labels, annotations, priority class, scheduling, image pull secrets).

A worker whose engine is vllm runs two containers: the splitserve worker (the same container, told to attach to
the server beside it) and a stock vLLM server (`images.vllm`), whose command line and environment come from
`splitserve.vllm_engine.server`, the one translation of the config that local runs use too.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

from splitserve.common import engines
from splitserve.common.config import ClusterResource, ClusterSpec, RoleSpec
from splitserve.common.model_files import EMBEDDED
from splitserve.hosts.common import redis_options, worker_argv
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.checks import gpus_per_pod
from splitserve.vllm_engine import server as vllm_server

WORKER_PORT_NAMES = ("grpc", "metrics")

RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": names.IMAGE_USER, "runAsGroup": names.IMAGE_USER,
                  "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]}}
# cpu and memory for a container whose spec names neither a request nor a limit of them
WORKER_RESOURCES = {"cpu": "1", "memory": "4Gi"}
GATEWAY_RESOURCES = {"cpu": "500m", "memory": "1Gi"}
REDIS_CPU = {"requests": "100m", "limits": "1"}
REDIS_SMALL_MEMORY = "256Mi"  # the bundled Redis's memory request without the KV pool
REDIS_OVERHEAD_MIB = 128  # Redis's memory past maxmemory (clients, fragmentation: 25% more is allowed too)
_REDIS_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
# engine vllm: the splitserve worker beside the server only relays (gRPC in, HTTP and ZMQ to the server)
VLLM_SIDECAR_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
VLLM_SHM_SIZE = "16Gi"  # the vLLM container's /dev/shm unless kubernetes.shmSize says otherwise
VLLM_USER = "splitserve"  # $USER: torch's getpass.getuser() fails on a uid the image's /etc/passwd lacks
CONNECTOR_VOLUME, CONNECTOR_DIR = "pool-connector", "/opt/splitserve/python"  # engine vllm with kvPool
VLLM_PROBE_PERIOD = 10  # seconds between the vLLM server's startup (and liveness) probes
_POD_IP = "$(POD_IP)"  # what `environment` is given as the side-channel host; rendered from the downward API
_VLLM_HEALTH = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=4)"
# A vLLM container's preStop. The kubelet stops a pod's containers at once; the server keeps serving (up to
# the role's drainSeconds) while the worker beside it drains its requests through it, i.e. while the worker's
# /healthz answers 200 (it stops listening once drained; a worker whose server died answers 503).
_WAIT_FOR_WORKER = """\
import time, urllib.request
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    try:
        urllib.request.urlopen("http://127.0.0.1:{port}/healthz", timeout=4).close()
    except OSError:
        break
    time.sleep(1)
"""


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over`'s keys on top of `base`, nested mappings merged key by key (as Helm merges values)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def completed_resources(given: dict[str, dict[str, int | str]], default: dict[str, str]) -> dict[str, Any]:
    """`given` with a request and a limit of cpu and memory: a side left out takes the other side's value, a
    resource neither names takes `default`'s. Other resources (GPUs, RDMA devices) are kept as given."""
    requests, limits = dict(given.get("requests", {})), dict(given.get("limits", {}))
    for key in ("cpu", "memory"):
        requests.setdefault(key, limits.get(key, default[key]))
        limits.setdefault(key, requests[key])
    return {**given, "requests": requests, "limits": limits}


def _cpu_and_memory(resources: dict[str, Any]) -> dict[str, Any]:
    """The cpu and memory part of completed resources (an init container's: it needs no GPU)."""
    return {side: {k: v for k, v in resources[side].items() if k in ("cpu", "memory")}
            for side in ("requests", "limits")}


def redis_memory(max_memory: str) -> str:
    """The bundled Redis's memory request and limit for a kvPool.maxMemory (Redis units: b, kb, mb, gb)."""
    m = re.fullmatch(r"([0-9]+)(b|kb|mb|gb)?", max_memory)
    assert m is not None, max_memory  # the model's pattern
    mib = int(m.group(1)) * _REDIS_UNITS[m.group(2) or "b"] / (1 << 20)
    return f"{math.ceil(mib * 1.25) + REDIS_OVERHEAD_MIB}Mi"


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _common_env(resource: ClusterResource, cache: str = names.CACHE_DIR) -> list[dict[str, Any]]:
    env = [{"name": "SPLITSERVE_CACHE", "value": cache}, {"name": "HOME", "value": names.TMP_DIR}]
    secret = resource.spec.redis.url_secret
    if resource.spec.redis.mode == "external" and secret is not None:
        env.append(_secret_env("SPLITSERVE_REDIS_URL", secret.name, secret.key))
    return env


def _volumes(resource: ClusterResource, cache: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of a splitserve pod: the rendered config, /tmp, the model cache (workers: `cache`) and
    the model volume."""
    k8s = resource.spec.kubernetes
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.config_map_name(resource.metadata.name)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [{"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True},
              {"name": "tmp", "mountPath": names.TMP_DIR}]
    if cache:
        volumes.append({"name": "cache", "emptyDir": {}})
        mounts.append({"name": "cache", "mountPath": names.CACHE_DIR})
    if k8s.model_volume:
        volumes.append({"name": "model", **k8s.model_volume})
        mounts.append({"name": "model", "mountPath": k8s.model_mount_path, "readOnly": True})
    return volumes, mounts


def _security_context(resource: ClusterResource, **extra: Any) -> dict[str, Any]:
    return merged({**RESTRICTED_CONTAINER, **extra}, resource.spec.kubernetes.security_context)


def _fetch_models(resource: ClusterResource, mounts: list[dict[str, Any]],
                  resources: dict[str, Any]) -> list[dict[str, Any]]:
    """Init containers that put the embedded model (and tokenizer) into a worker pod's cache."""
    model = resource.spec.model
    wanted = [n for n in dict.fromkeys([model.name, model.tokenizer]) if n in EMBEDDED]
    images = resource.spec.images
    return [{"name": f"fetch-{n}", "image": images.worker, "imagePullPolicy": images.pull_policy,
             "command": ["splitserve", "fetch-model", n], "env": _common_env(resource),
             "resources": _cpu_and_memory(resources),  # the pod's request is already the worker's: no extra
             "volumeMounts": [dict(m) for m in mounts if m["name"] in ("cache", "tmp")],
             "securityContext": _security_context(resource)} for n in wanted]


def _pool_connector(resource: ClusterResource, resources: dict[str, Any]) -> dict[str, Any]:
    """The init container that copies splitserve's vLLM connectors (the KV pool's, the layerwise one: the modules
    they import, redis-py) into the volume the vLLM container puts on its PYTHONPATH: `images.vllm` may be the
    stock image."""
    images = resource.spec.images
    return {"name": "pool-connector", "image": images.worker, "imagePullPolicy": images.pull_policy,
            "command": ["splitserve", "vllm-connector", CONNECTOR_DIR],
            "resources": _cpu_and_memory(resources),
            "volumeMounts": [{"name": CONNECTOR_VOLUME, "mountPath": CONNECTOR_DIR}],
            "securityContext": _security_context(resource)}


def _http_probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


def worker_command(role: str) -> list[str]:
    """A worker's command line: the image's `splitserve`, named and advertised as its pod (POD_NAME and POD_IP
    come from the downward API), its ports the role's own from the rendered config."""
    return worker_argv(role, names.CONFIG_PATH, "0.0.0.0", "$(POD_NAME)", program=["splitserve"],
                       advertise_host="$(POD_IP)")


def gateway_command() -> list[str]:
    return ["splitserve", "router", "--config", names.CONFIG_PATH, "--host", "0.0.0.0"]


def _template(resource: ClusterResource, pod_labels: dict[str, str], annotations: dict[str, str],
              pod: dict[str, Any], role: RoleSpec | None = None) -> dict[str, Any]:
    """A pod template with the cluster's pod-level settings (and a worker role's scheduling) applied."""
    k8s = resource.spec.kubernetes
    pod = {
        **pod,
        "securityContext": merged(RESTRICTED_POD, k8s.pod_security_context),
        "imagePullSecrets": [{"name": s.name} for s in k8s.image_pull_secrets],
        "priorityClassName": k8s.priority_class_name,
        "nodeSelector": {**k8s.node_selector, **(role.node_selector if role else {})},
        "tolerations": [*k8s.tolerations, *(role.tolerations if role else [])],
        "affinity": (role.affinity if role else None) or k8s.affinity,
    }
    metadata = {"labels": {**k8s.pod_labels, **pod_labels}, "annotations": {**k8s.pod_annotations, **annotations}}
    return {"metadata": {k: v for k, v in metadata.items() if v},
            "spec": {k: v for k, v in pod.items() if v not in ({}, [], None)}}


def worker_pod(resource: ClusterResource, component: str, role: str, spec: RoleSpec,
               pod_labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    """The pod template of one worker role (`role`: prefill, decode or both)."""
    k8s, images = resource.spec.kubernetes, resource.spec.images
    kind = resource.spec.engine_of(role)
    pod_server = engines.get(kind).resolve_pod_server()  # engine vllm: its server is a container of the pod
    volumes, mounts = _volumes(resource, cache=True)
    if k8s.shm_size and pod_server is None:  # a vLLM pod's /dev/shm is its server's (`_vllm_server`)
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    env = [_field_env("POD_NAME", "metadata.name"), _field_env("POD_IP", "status.podIP"),
           _field_env("POD_NAMESPACE", "metadata.namespace"), *_common_env(resource)]
    resources = completed_resources(spec.resources, WORKER_RESOURCES)
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
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": _security_context(resource),
    }
    containers = [container]
    init = _fetch_models(resource, mounts, resources)
    if pod_server is not None:
        # The worker (still containers[0]: kubectl's default) attaches to the server; the role's resources,
        # GPUs included, are the server's.
        server = pod_server(resource, role, spec, resources)
        container["command"] = [*worker_command(role), "--engine", kind, *server.worker_args]
        container["resources"] = server.worker_resources
        containers.append(server.container)
        volumes += server.volumes
        init += server.init_containers
    pod: dict[str, Any] = {
        # SIGTERM starts the drain (the worker leaves the registry, finishes what is in flight, exits).
        "terminationGracePeriodSeconds": math.ceil(spec.drain_seconds) + names.DRAIN_MARGIN_SECONDS,
        "initContainers": init,
        "containers": containers,
        "volumes": volumes,
        "hostIPC": k8s.host_ipc,  # outside the restricted (and baseline) standard: only when asked for
        "enableServiceLinks": False,
    }
    return _template(resource, pod_labels, annotations, pod, spec)


def _on_pod_device(spec: ClusterSpec, role: RoleSpec) -> ClusterSpec:
    """`spec` with model.device auto decided as the pod will run: cuda when the role asks for GPUs, else cpu.
    `vllm_engine.server` decides auto by looking for a GPU on its own host, which here is the operator's."""
    if spec.model.device != "auto":
        return spec
    device = "cuda" if gpus_per_pod(role) else "cpu"
    return spec.model_copy(update={"model": spec.model.model_copy(update={"device": device})})


def _model_dir(resource: ClusterResource) -> str:
    """The model directory as a worker pod's containers see it: the embedded model's converted copy in the pod's
    cache (where the init container puts it and `model_files.resolve_model` finds it), else model.name itself
    (a directory under kubernetes.modelMountPath)."""
    name = resource.spec.model.name
    return f"{names.CACHE_DIR}/models/{name}" if name in EMBEDDED else name


def _python_probe(script: str, period: int, failures: int) -> dict[str, Any]:
    """A probe run inside the vLLM container: the server listens on loopback only, which an httpGet probe (sent
    by the kubelet to the pod's IP) cannot reach."""
    return {"exec": {"command": ["python3", "-c", script]}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


@dataclass(frozen=True)
class PodServer:
    """An engine's server as a container of the worker's pod: what the worker's command line adds (after
    `--engine`) to attach to it, the worker container's resources (the role's go to the server), and the server's
    container, volumes and init containers."""

    worker_args: list[str]
    worker_resources: dict[str, Any]
    container: dict[str, Any]
    volumes: list[dict[str, Any]]
    init_containers: list[dict[str, Any]]


def vllm_pod_server(resource: ClusterResource, role: str, spec: RoleSpec, resources: dict[str, Any]) -> PodServer:
    """Engine vllm's part of a worker pod (`splitserve.common.engines` names it): a stock vLLM server beside the
    worker, and the init container that copies splitserve's connectors for it when it loads one."""
    server, volumes = _vllm_server(resource, role, spec, resources)
    init = [_pool_connector(resource, resources)] if vllm_server.needs_connector_files(resource.spec, role) else []
    return PodServer(["--vllm-url", f"http://127.0.0.1:{resource.spec.vllm.port}"],
                     copy.deepcopy(VLLM_SIDECAR_RESOURCES), server, volumes, init)


def _vllm_server(resource: ClusterResource, role: str, spec: RoleSpec,
                 resources: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the vLLM server's container, the volumes only it mounts) of a worker pod with engine vllm."""
    cluster, images, k8s = _on_pod_device(resource.spec, spec), resource.spec.images, resource.spec.kubernetes
    v = cluster.vllm
    ports = vllm_server.VllmPorts(v.port, v.events_port, v.side_channel_port)
    # The image runs as the pod's user under a read-only root: HOME (HF, vLLM, Triton and FlashInfer caches)
    # and /tmp (TorchInductor, vLLM's IPC sockets) are an emptyDir of its own.
    env: list[dict[str, Any]] = [{"name": "HOME", "value": names.TMP_DIR}, {"name": "USER", "value": VLLM_USER}]
    for key, value in vllm_server.environment(cluster, role, ports, side_channel_host=_POD_IP).items():
        # the NIXL handshake address the other servers dial: this pod's IP
        env.append(_field_env(key, "status.podIP") if value == _POD_IP else {"name": key, "value": value})
    secret = cluster.redis.url_secret
    if cluster.kv_pool.enabled and cluster.redis.mode == "external" and secret is not None:  # the pool connector's
        env.append(_secret_env("SPLITSERVE_REDIS_URL", secret.name, secret.key))
    volumes = [{"name": "vllm-tmp", "emptyDir": {}},
               {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size or VLLM_SHM_SIZE}}]
    mounts = [{"name": "vllm-tmp", "mountPath": names.TMP_DIR}, {"name": "shm", "mountPath": "/dev/shm"}]
    if cluster.model.name in EMBEDDED:  # converted by the init container, as the worker reads it too
        mounts.append({"name": "cache", "mountPath": names.CACHE_DIR, "readOnly": True})
    if k8s.model_volume:
        mounts.append({"name": "model", "mountPath": k8s.model_mount_path, "readOnly": True})
    if vllm_server.needs_connector_files(cluster, role):  # splitserve's connectors, copied by the `pool-connector` init container
        volumes.append({"name": CONNECTOR_VOLUME, "emptyDir": {}})
        mounts.append({"name": CONNECTOR_VOLUME, "mountPath": CONNECTOR_DIR, "readOnly": True})
        env.append({"name": "PYTHONPATH", "value": CONNECTOR_DIR})
    health = _VLLM_HEALTH.format(port=v.port)
    wait = _WAIT_FOR_WORKER.format(seconds=math.ceil(spec.drain_seconds), port=spec.metrics_port)
    container: dict[str, Any] = {
        "name": "vllm",
        "image": images.vllm,
        "imagePullPolicy": images.pull_policy,
        "command": vllm_server.command(cluster, role, _model_dir(resource), ports, python="python3"),
        "env": env,
        # loading, profiling and compiling take up to vllm.startupSeconds; the worker beside it waits as long
        "startupProbe": _python_probe(health, VLLM_PROBE_PERIOD, math.ceil(v.startup_seconds / VLLM_PROBE_PERIOD)),
        "livenessProbe": _python_probe(health, VLLM_PROBE_PERIOD, 3),
        "lifecycle": {"preStop": {"exec": {"command": ["python3", "-c", wait]}}},
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": _security_context(resource),
    }
    if vllm_server.disaggregated(cluster, role):  # the other servers dial its NIXL handshake
        container["ports"] = [{"name": "nixl", "containerPort": v.side_channel_port, "protocol": "TCP"}]
    return container, volumes


def gateway_pod(resource: ClusterResource, pod_labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    """The gateway: the slim image, whose own SPLITSERVE_CACHE holds the embedded models' tokenizers."""
    spec, images = resource.spec, resource.spec.images
    volumes, mounts = _volumes(resource, cache=False)
    env = _common_env(resource, cache=names.GATEWAY_CACHE_DIR)
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
        "resources": completed_resources(spec.router.resources, GATEWAY_RESOURCES),
        "volumeMounts": mounts,
        "securityContext": _security_context(resource),
    }
    pod: dict[str, Any] = {"containers": [container], "volumes": volumes, "enableServiceLinks": False}
    return _template(resource, pod_labels, annotations, pod)


def redis_pod(resource: ClusterResource, pod_labels: dict[str, str]) -> dict[str, Any]:
    """The bundled Redis: soft state only (registry, KV index, KV pool), so no persistence; its memory is
    kvPool.maxMemory (pool blocks carry a TTL, so volatile-lru evicts them and never the event stream, as
    `splitserve up` runs it) plus headroom as its limit."""
    images, memory = resource.spec.images, redis_memory(resource.spec.kv_pool.max_memory)
    container = {
        "name": "redis",
        "image": images.redis,
        "imagePullPolicy": images.pull_policy,
        "args": redis_options(resource.spec.kv_pool.max_memory),
        "ports": [{"name": "redis", "containerPort": names.REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 3},
        # without the KV pool Redis holds the registry and the KV index only: its request is small
        "resources": {"requests": {"cpu": REDIS_CPU["requests"],
                                   "memory": memory if resource.spec.kv_pool.enabled else REDIS_SMALL_MEMORY},
                      "limits": {"cpu": REDIS_CPU["limits"], "memory": memory}},
        "volumeMounts": [{"name": "data", "mountPath": names.REDIS_DATA_DIR}],
        "securityContext": _security_context(resource, runAsUser=names.REDIS_USER, runAsGroup=names.REDIS_GROUP),
    }
    pod = {"containers": [container], "volumes": [{"name": "data", "emptyDir": {}}], "enableServiceLinks": False}
    return _template(resource, pod_labels, {}, pod)
