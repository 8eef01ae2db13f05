"""Every Kubernetes name the operator writes: the API group, kinds and their REST paths, object names, labels,
annotations, paths inside pods and the bundled Redis URL. One module owns them, so the operator, the CRDs, the
chart and the tests never spell a key twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.config import API_VERSION, KIND

GROUP, VERSION = API_VERSION.split("/")
CLUSTER_PLURAL = "splitserveclusters"
ROLE_KIND = "SplitServeRole"
ROLE_PLURAL = "splitserveroles"
FIELD_MANAGER = "splitserve-operator"
FINALIZER = "splitserve.dev/operator"

CONFIG_DIR = "/etc/splitserve"
CONFIG_FILE = "cluster.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
CACHE_DIR = "/var/cache/splitserve"  # SPLITSERVE_CACHE: fetched models (an emptyDir per pod)
# The gateway image's SPLITSERVE_CACHE: the embedded models' tokenizers, baked in at build time (Dockerfile)
GATEWAY_CACHE_DIR = "/opt/splitserve/cache"
TMP_DIR = "/tmp"  # an emptyDir in every splitserve pod (root filesystems are read-only); also its HOME
IMAGE_USER = 10001  # the images' user (Dockerfile: useradd --uid 10001), the pods' runAsUser and runAsGroup
REDIS_USER, REDIS_GROUP = 999, 1000  # the redis:*-alpine image's redis user
REDIS_DATA_DIR = "/data"  # the Redis image's working directory
REDIS_PORT = 6379
DRAIN_MARGIN_SECONDS = 30  # terminationGracePeriodSeconds = drainSeconds + this (the gRPC and HTTP servers' stop)

# labels
CLUSTER_LABEL = "splitserve.dev/cluster"
ROLE_LABEL = "splitserve.dev/role"
CONFIG_HASH_ANNOTATION = "splitserve.dev/config-hash"
APPLIED_HASH_ANNOTATION = "splitserve.dev/applied-hash"  # of the object as last applied: a field dropped re-applies
# a ReplicaSet's scale-down takes pods of a lower cost first: a flipped pod (serving the other role) gets a high one
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
MANAGED_BY = "splitserve-operator"


@dataclass(frozen=True)
class Kind:
    """A resource the operator reads or writes: its apiVersion, kind and plural (the REST path's last part)."""

    api_version: str
    kind: str
    plural: str

    def path(self, namespace: str, name: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{base}/namespaces/{namespace}/{self.plural}" + (f"/{name}" if name else "")


CLUSTER = Kind(API_VERSION, KIND, CLUSTER_PLURAL)
ROLE = Kind(API_VERSION, ROLE_KIND, ROLE_PLURAL)
CONFIGMAP = Kind("v1", "ConfigMap", "configmaps")
SERVICE = Kind("v1", "Service", "services")
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
STATEFULSET = Kind("apps/v1", "StatefulSet", "statefulsets")
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
POD = Kind("v1", "Pod", "pods")  # patched only: a flipped pod's deletion cost
# What a cluster may own, in the order children are applied (config first: pods mount it) and pruned.
OWNED = (CONFIGMAP, SERVICE, STATEFULSET, DEPLOYMENT, PDB, ROLE)
KINDS = {k.kind: k for k in (*OWNED, CLUSTER)}

# components: a pod's splitserve.dev/role label and the suffix of its objects' names
GATEWAY, PREFILL, DECODE, REDIS = "gateway", "prefill", "decode", "redis"


def child_name(cluster: str, component: str) -> str:
    """`<cluster>-<component>`: Deployments, Services, PDBs and SplitServeRoles share it."""
    return f"{cluster}-{component}"


def config_map_name(cluster: str) -> str:
    return f"{cluster}-config"


def redis_url(cluster: str) -> str:
    """The bundled Redis, as every component of the cluster reaches it (its Service's DNS name)."""
    return f"redis://{child_name(cluster, REDIS)}:{REDIS_PORT}/0"


def selector(cluster: str, component: str) -> dict[str, str]:
    """The pod selector of one component (immutable once a Deployment exists, so only these two keys)."""
    return {CLUSTER_LABEL: cluster, ROLE_LABEL: component}


def selector_string(cluster: str, component: str) -> str:
    """The same selector as a label query (a SplitServeRole's status.selector, read by HPA)."""
    return ",".join(f"{k}={v}" for k, v in selector(cluster, component).items())


def labels(cluster: str, component: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The labels on everything the operator creates: the user's metadata.labels, the recommended
    app.kubernetes.io set and splitserve.dev/cluster (+ /role for a component's objects)."""
    out = dict(extra or {})
    out.update({
        "app.kubernetes.io/name": "splitserve",
        "app.kubernetes.io/instance": cluster,
        "app.kubernetes.io/part-of": "splitserve",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        CLUSTER_LABEL: cluster,
    })
    if component:
        out["app.kubernetes.io/component"] = component
        out[ROLE_LABEL] = component
    return out
