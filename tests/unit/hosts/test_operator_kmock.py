"""The operator, run for real (kopf, the kubernetes client, HTTP) against kmock's Kubernetes emulator, which
stands in for the API server because none can run here. Each test starts `splitserve operator`'s event loop in a
thread of its own, writes SplitServeClusters through the API and waits for the children and the status.

kmock stores objects as JSON and merges patches; it runs no controllers (no garbage collector, no Deployment
controller), assigns no uid, generation or resourceVersion, and does not filter lists by label. The tests play
those parts where they need them: they set uid, generation and resourceVersion on the resources they create, and
write Deployment status by hand.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import kmock
import kopf
import pytest
import yaml

from splitserve.common.config import ClusterResource
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.kube import Kube
from splitserve.hosts.k8s.reconcile import Deps
from splitserve.hosts.k8s.run import operate

NS = "default"
CLUSTERS = f"{names.GROUP}/{names.VERSION}/{names.CLUSTER_PLURAL}"
ROLES = f"{names.GROUP}/{names.VERSION}/{names.ROLE_PLURAL}"
DEPLOYMENTS, STATEFULSETS = "apps/v1/deployments", "apps/v1/statefulsets"
SERVICES, CONFIGMAPS, PDBS = "v1/services", "v1/configmaps", "policy/v1/poddisruptionbudgets"
OWNED = (CONFIGMAPS, SERVICES, STATEFULSETS, DEPLOYMENTS, PDBS, ROLES)
VERBS = {"get", "list", "watch", "create", "patch", "delete"}


def serve_cluster_api(emulator: kmock.KubernetesEmulator) -> None:
    """Declare what a cluster with the CRDs installed serves (kopf discovers these before it watches)."""
    info = kmock.ResourceInfo
    emulator.resources[CLUSTERS] = info(kind=names.CLUSTER.kind, namespaced=True, verbs=VERBS, subresources={"status"})
    emulator.resources[ROLES] = info(kind=names.ROLE.kind, namespaced=True, verbs=VERBS,
                                     subresources={"status", "scale"})
    for path, kind in ((DEPLOYMENTS, "Deployment"), (STATEFULSETS, "StatefulSet"), (SERVICES, "Service"),
                       (CONFIGMAPS, "ConfigMap"), (PDBS, "PodDisruptionBudget"), ("v1/events", "Event")):
        emulator.resources[path] = info(kind=kind, namespaced=True, verbs=VERBS)
    emulator.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs={"list", "watch"})
    emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch"})


class Operator:
    """`splitserve operator`'s `operate()` in a thread of its own (its own event loop), against `url`."""

    def __init__(self, url: str, resync_seconds: float = 1.0) -> None:
        self.url = url.rstrip("/")
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()

        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=self.url)

        deps = Deps(Kube.for_url(self.url))
        coro = operate(deps, login, namespaces=[NS], resync_seconds=resync_seconds, stop_flag=self.stop_flag,
                       ready_flag=self.ready_flag)
        self.thread = threading.Thread(target=asyncio.run, args=(coro,), name="operator", daemon=True)

    async def __aenter__(self) -> Operator:
        self.thread.start()
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop and join it without blocking this loop (the emulator serves the operator's last calls here)."""
        self.stop_flag.set()
        await asyncio.to_thread(self.thread.join, 20)
        assert not self.thread.is_alive(), "the operator did not stop"


def live(emulator: kmock.KubernetesEmulator, plural: str) -> dict[str, dict[str, Any]]:
    """The objects of one resource that exist now, by name (deep copies)."""
    wanted = kmock.resource(plural)
    return {name: copy.deepcopy(obj.raw) for (res, _, name), obj in emulator.objects.items()
            if res == wanted and not obj.deleted}


def owned(emulator: kmock.KubernetesEmulator) -> dict[str, set[str]]:
    return {plural: set(live(emulator, plural)) for plural in OWNED}


def cluster_doc(name: str, spec: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    return {"apiVersion": names.CLUSTER.api_version, "kind": names.CLUSTER.kind,
            "metadata": {"name": name, "namespace": NS, "uid": uid, "generation": 1, "resourceVersion": "1"},
            "spec": spec}


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    """Poll `check` (it raises AssertionError or returns falsy until it holds) for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result or result is None:
                return result
            error: Exception = AssertionError(f"{what or check.__name__}: still {result!r}")
        except (AssertionError, KeyError) as e:
            error = e
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or getattr(check, '__name__', 'check')}") from error
        await asyncio.sleep(0.1)



pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
CLUSTER_PATH = f"/apis/{CLUSTERS.rsplit('/', 1)[0]}/namespaces/{NS}/splitserveclusters"
ROLE_PATH = f"/apis/{ROLES.rsplit('/', 1)[0]}/namespaces/{NS}/splitserveroles"
GPU_SPEC = {
    "model": {"name": "smollm2", "device": "cuda"},
    "prefill": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}}},
    "decode": {"replicas": 3, "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}}},
    "ratio": {"min": 0.25, "max": 1.0},
    "redis": {"mode": "bundled"},
}


@pytest.fixture
def api(kmock: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    serve_cluster_api(kmock)
    return kmock


async def create(api: kmock.KubernetesEmulator, name: str, spec: dict) -> None:
    resp = await api.post(CLUSTER_PATH, json=cluster_doc(name, spec))
    assert resp.status == 200, await resp.text()


async def change(api: kmock.KubernetesEmulator, name: str, spec: dict, generation: int) -> None:
    """A spec change as the API server makes it: merged, with the generation bumped (kmock does not)."""
    resp = await api.patch(f"{CLUSTER_PATH}/{name}", json={"metadata": {"generation": generation}, "spec": spec})
    assert resp.status == 200, await resp.text()


def status(api: kmock.KubernetesEmulator, name: str) -> dict:
    return live(api, CLUSTERS)[name].get("status") or {}


def condition(api: kmock.KubernetesEmulator, name: str, type_: str) -> dict:
    return next((c for c in status(api, name).get("conditions", []) if c["type"] == type_), {})


def replicas(api: kmock.KubernetesEmulator) -> dict[str, int]:
    return {n: d["spec"]["replicas"] for n, d in live(api, DEPLOYMENTS).items()}


async def test_create_makes_every_child_with_replicas_resources_and_owner(api):
    """kmock stands in for the API server (none can run here). Creating a GPU cluster yields the ConfigMap, the
    bundled Redis, a Deployment/Service/PDB per component and a SplitServeRole per role, all owned by it."""
    async with Operator(str(api.url)):
        await create(api, "llm", GPU_SPEC)
        await eventually(lambda: condition(api, "llm", "Ready").get("reason") == "ReplicasNotReady")
        assert owned(api) == {
            CONFIGMAPS: {"llm-config"},
            SERVICES: {"llm-gateway", "llm-prefill", "llm-decode", "llm-redis"},
            STATEFULSETS: {"llm-redis"},
            DEPLOYMENTS: {"llm-gateway", "llm-prefill", "llm-decode"},
            PDBS: {"llm-gateway", "llm-prefill", "llm-decode"},
            ROLES: {"llm-prefill", "llm-decode"},
        }
        assert replicas(api) == {"llm-gateway": 1, "llm-prefill": 1, "llm-decode": 3}
        decode = live(api, DEPLOYMENTS)["llm-decode"]
        container = decode["spec"]["template"]["spec"]["containers"][0]
        # cpu and memory completed to a request and a limit each (a ResourceQuota admits the pod)
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi", "cpu": "1"},
                                          "requests": {"cpu": "1", "memory": "16Gi"}}
        assert container["command"][:6] == ["splitserve", "worker", "--config", "/etc/splitserve/cluster.yaml",
                                            "--role", "decode"]
        assert decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 150  # drainSeconds 120 + 30
        for plural in (CONFIGMAPS, SERVICES, STATEFULSETS, DEPLOYMENTS, PDBS, ROLES):
            for obj in live(api, plural).values():
                [owner] = obj["metadata"]["ownerReferences"]
                assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == \
                    ("SplitServeCluster", "llm", "uid-1", True)
                assert obj["metadata"]["labels"]["splitserve.dev/cluster"] == "llm"
        config = ClusterResource.model_validate(yaml.safe_load(live(api, CONFIGMAPS)["llm-config"]["data"]["cluster.yaml"]))
        assert config.spec.redis.mode == "bundled" and config.spec.redis.url == "redis://llm-redis:6379/0"
        st = status(api, "llm")
        assert st["desiredReplicas"] == {"prefill": 1, "decode": 3, "gateway": 1}
        assert (st["prefill"], st["decode"], st["ratio"], st["model"]) == ("0/1", "0/3", 0.3333, "smollm2")
        assert condition(api, "llm", "Degraded")["status"] == "False"

        # The Deployment controller's part (kmock has none): pods become ready → Ready, roles report their pods.
        for name, n in replicas(api).items():
            await api.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/status",
                            json={"status": {"replicas": n, "readyReplicas": n}})
        await eventually(lambda: condition(api, "llm", "Ready")["status"] == "True")
        assert condition(api, "llm", "Progressing")["status"] == "False"
        assert live(api, ROLES)["llm-decode"]["status"] == {
            "replicas": 3, "readyReplicas": 3, "selector": "splitserve.dev/cluster=llm,splitserve.dev/role=decode"}


async def test_spec_changes_are_patched_and_clamped_values_show_in_status(api):
    """kmock stands in for the API server (none can run here). Raising decode to 8 under ratio.min 0.25 raises
    prefill to 2; tightening ratio.max then caps decode; Redis gone external removes the bundled one."""
    async with Operator(str(api.url)):
        await create(api, "llm", GPU_SPEC)
        await eventually(lambda: replicas(api).get("llm-decode") == 3)
        await change(api, "llm", {"decode": {"replicas": 8}}, generation=2)
        await eventually(lambda: replicas(api) == {"llm-gateway": 1, "llm-prefill": 2, "llm-decode": 8})
        await eventually(lambda: status(api, "llm")["lastDecision"]["decode"] == 8)
        decision = status(api, "llm")["lastDecision"]
        assert decision["prefill"] == 2
        assert "ratio.min 0.25" in decision["reason"] and "asked prefill 1, decode 8" in decision["reason"]
        assert status(api, "llm")["ratio"] == 0.25
        assert condition(api, "llm", "Ready")["observedGeneration"] == 2

        await change(api, "llm", {"ratio": {"min": 0.5}, "redis": {"mode": "external", "url": "redis://r:6379/0"}},
                     generation=3)
        await eventually(lambda: replicas(api)["llm-prefill"] == 4)
        await eventually(lambda: "llm-redis" not in live(api, STATEFULSETS) and "llm-redis" not in live(api, SERVICES))
        await eventually(lambda: status(api, "llm")["desiredReplicas"]["prefill"] == 4)
        assert status(api, "llm")["desiredReplicas"] == {"prefill": 4, "decode": 8, "gateway": 1}


async def test_scale_subresource_drives_replicas_in_external_mode(api):
    """kmock stands in for the API server (none can run here). In autoscaling.mode external, what HPA/KEDA
    write on a SplitServeRole's replicas reaches the Deployment, clamped to maxReplicas."""
    spec = copy.deepcopy(GPU_SPEC) | {"autoscaling": {"mode": "external"}}
    spec["decode"]["maxReplicas"] = 6
    async with Operator(str(api.url)):
        await create(api, "llm", spec)
        await eventually(lambda: "llm-decode" in live(api, ROLES))
        await api.patch(f"{ROLE_PATH}/llm-decode", json={"spec": {"replicas": 5}})  # what HPA writes via /scale
        await eventually(lambda: replicas(api)["llm-decode"] == 5)
        await api.patch(f"{ROLE_PATH}/llm-decode", json={"spec": {"replicas": 20}})
        await eventually(lambda: replicas(api)["llm-decode"] == 6)
        await eventually(lambda: status(api, "llm")["lastDecision"]["decode"] == 6)
        assert live(api, ROLES)["llm-decode"]["spec"]["replicas"] == 20  # HPA's number stays HPA's
        assert "decode.maxReplicas 6" in status(api, "llm")["lastDecision"]["reason"]


async def test_delete_removes_every_child(api):
    """kmock stands in for the API server (none can run here, nor its garbage collector): the operator's
    finalizer deletes the children itself, then lets the resource go."""
    async with Operator(str(api.url)):
        await create(api, "llm", GPU_SPEC)
        await eventually(lambda: len(live(api, DEPLOYMENTS)) == 3)
        assert live(api, CLUSTERS)["llm"]["metadata"]["finalizers"] == ["splitserve.dev/operator"]
        resp = await api.delete(f"{CLUSTER_PATH}/llm")
        assert resp.status == 200
        await eventually(lambda: "llm" not in live(api, CLUSTERS))
        assert owned(api) == {plural: set() for plural in owned(api)}


async def test_unrealisable_spec_is_degraded_with_its_reason_then_recovers(api):
    """kmock stands in for the API server (none can run here). External Redis with no URL is valid for the
    schema but cannot run: Degraded with the reason, nothing created; fixing the spec brings it up."""
    async with Operator(str(api.url)):
        await create(api, "llm", GPU_SPEC | {"redis": {"mode": "external"}})
        await eventually(lambda: condition(api, "llm", "Degraded")["status"] == "True")
        degraded = condition(api, "llm", "Degraded")
        assert degraded["reason"] == "RedisURLMissing"
        assert "neither redis.url nor redis.urlSecret" in degraded["message"]
        assert condition(api, "llm", "Progressing")["reason"] == "Blocked"
        assert owned(api) == {plural: set() for plural in owned(api)}

        await change(api, "llm", {"redis": {"urlSecret": {"name": "redis", "key": "url"}}}, generation=2)
        await eventually(lambda: condition(api, "llm", "Degraded")["status"] == "False")
        gateway = live(api, DEPLOYMENTS)["llm-gateway"]["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "SPLITSERVE_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "redis", "key": "url"}}} \
            in gateway["env"]

        await change(api, "llm", {"prefill": {"minReplicas": 1}, "decode": {"minReplicas": 3},
                                  "autoscaling": {"gpuBudget": 3}}, generation=3)  # the minimums need 4 GPUs
        await eventually(lambda: condition(api, "llm", "Degraded")["reason"] == "GPUBudgetTooSmall")
        assert replicas(api)["llm-decode"] == 3  # nothing changed


async def test_restart_midway_converges_with_no_duplicates(api):
    """kmock stands in for the API server (none can run here). While the first operator runs, every Deployment
    create is answered 500 (kmock stores the object anyway, as after a lost response), so its passes break off
    half-way; it stops while waiting to retry. A second operator resumes and converges: each object exactly once,
    each with one owner."""
    failing = True
    broken = api["post /apis/apps/v1/namespaces/default/deployments"][lambda _: failing] << 500
    async with Operator(str(api.url), resync_seconds=60):  # no timer: only the passes that break off
        await create(api, "llm", GPU_SPEC)
        await eventually(lambda: len(broken) >= 1, what="a Deployment create answered 500")
    assert len(live(api, DEPLOYMENTS)) < 3 and len(live(api, PDBS)) < 3  # half made
    failing = False
    async with Operator(str(api.url)):
        await eventually(lambda: len(live(api, ROLES)) == 2 and len(live(api, PDBS)) == 3)
        await eventually(lambda: condition(api, "llm", "Ready").get("reason") == "ReplicasNotReady")
    expected = {
        CONFIGMAPS: {"llm-config"},
        SERVICES: {"llm-gateway", "llm-prefill", "llm-decode", "llm-redis"},
        STATEFULSETS: {"llm-redis"},
        DEPLOYMENTS: {"llm-gateway", "llm-prefill", "llm-decode"},
        PDBS: {"llm-gateway", "llm-prefill", "llm-decode"},
        ROLES: {"llm-prefill", "llm-decode"},
    }
    assert owned(api) == expected
    for plural in expected:
        for obj in live(api, plural).values():
            assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == ["uid-1"]
    assert replicas(api) == {"llm-gateway": 1, "llm-prefill": 1, "llm-decode": 3}
