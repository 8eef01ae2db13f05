"""The operator as the SLO law's Kubernetes and external actuators: kopf and the kubernetes client run for real
against kmock's Kubernetes emulator (it stands in for the API server, which cannot run here; it runs no
controllers, so the tests write Deployment status by hand). The law's observations come from real sources, not
fakes: a real redis-server holding the registry (written with the workers' own lease script) and a small HTTP
server serving the gateway's /metrics, injected as the observer (the operator reaches them through Services in a
cluster)."""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

import kmock
import kopf
import pytest
import redis
from prometheus_client import REGISTRY
from support.metrics_server import MetricsServer
from support.redis_server import RedisServer
from unit.hosts.test_operator_kmock import (
    CLUSTERS,
    DEPLOYMENTS,
    NS,
    ROLES,
    cluster_doc,
    eventually,
    live,
    serve_cluster_api,
)

from e2e.test_autoscaler_observer import entry, register
from splitserve.autoscaler.observer import Observer
from splitserve.hosts.k8s.kube import Kube
from splitserve.hosts.k8s.reconcile import Deps
from splitserve.hosts.k8s.run import operate
from splitserve.hosts.k8s.slo import SloReplicas

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(120)]
CLUSTER_PATH = f"/apis/{CLUSTERS.rsplit('/', 1)[0]}/namespaces/{NS}/splitserveclusters"
SPEC = {
    "model": {"name": "smollm2", "device": "cuda"},
    "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
    "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
    "redis": {"mode": "bundled"},
    # a 60-s cold start, not the profile's 20: the queue below is sized against it
    "autoscaling": {"mode": "slo", "intervalSeconds": 1, "scaleUpCooldownSeconds": 30, "coldStartSeconds": 60},
}


class Sources:
    """The observation sources the test injects: a real Redis registry and a gateway /metrics page."""

    def __init__(self) -> None:
        self.redis, self.metrics = RedisServer(), MetricsServer()
        self.client = redis.Redis.from_url(self.redis.url)
        self.metrics.pages["/gw/metrics"] = "# TYPE splitserve_requests counter\n"
        self.asked: list[tuple[str, str]] = []

    def observer(self, namespace: str, cluster: str, spec: Any) -> Observer:
        self.asked.append((namespace, cluster))
        return Observer(self.redis.url, spec.model.served_name, [f"{self.metrics.url}/gw"])

    def close(self) -> None:
        self.client.close()
        self.metrics.close()
        self.redis.close()


@pytest.fixture
def sources():
    s = Sources()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def api(kmock: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    serve_cluster_api(kmock)
    return kmock


class Operator:
    """`operate()` in its own thread and event loop, with the SLO provider as `Deps.desired`."""

    def __init__(self, url: str, desired: SloReplicas) -> None:
        self.stop_flag = threading.Event()

        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url.rstrip("/"))

        coro = operate(Deps(Kube.for_url(url.rstrip("/")), desired), login, namespaces=[NS], resync_seconds=1.0,
                       autoscale_seconds=0.5, stop_flag=self.stop_flag)
        self.thread = threading.Thread(target=asyncio.run, args=(coro,), name="operator", daemon=True)

    async def __aenter__(self) -> Operator:
        self.thread.start()
        return self

    async def __aexit__(self, *_: Any) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self.thread.join, 20)
        assert not self.thread.is_alive(), "the operator did not stop"


def deployments(api: kmock.KubernetesEmulator) -> dict[str, int]:
    return {n: d["spec"]["replicas"] for n, d in live(api, DEPLOYMENTS).items()}


QUEUE_TOKENS = 3_200_000


def queue_on_prefill(sources: Sources) -> None:
    """One ready prefill worker with a long queue (the registry's load report), one idle decode worker. The queue
    takes the worker ~89 s to drain (the 8B H200 profile), longer than the 60-s cold start: a second replica helps it (a
    queue the ready replicas clear before a new one loads is a clump, which buys nothing)."""
    register(sources.client, entry("llm-prefill-a", "prefill", 5001, "", num_waiting=40,
                                   waiting_prefill_tokens=QUEUE_TOKENS, num_running=1))
    register(sources.client, entry("llm-decode-a", "decode", 5002, ""))


def desired_metric(cluster: str, role: str) -> float | None:
    return REGISTRY.get_sample_value("splitserve_autoscaler_desired_replicas", {"cluster": cluster, "role": role})


async def test_slo_mode_applies_the_laws_decision_to_roles_deployments_and_status(api, sources):
    """kmock emulates the API server. A prefill queue in the registry is a burst: the law scales prefill up; the
    operator applies it to the SplitServeRole and the Deployment and writes status.lastDecision with the law's
    reason; decode, idle, holds. While the new replica starts, the decision holds (no second scale-up)."""
    queue_on_prefill(sources)
    async with Operator(str(api.url), SloReplicas(observers=sources.observer)):
        resp = await api.post(CLUSTER_PATH, json=cluster_doc("llm", SPEC))
        assert resp.status == 200, await resp.text()
        await eventually(lambda: deployments(api).get("llm-prefill") == 2, timeout=30,
                         what="prefill Deployment scaled to 2")
        await eventually(lambda: live(api, CLUSTERS)["llm"]["status"]["lastDecision"]["prefill"] == 2,
                         what="the decision in status")
        status = live(api, CLUSTERS)["llm"]["status"]
        decision = status["lastDecision"]
        assert (decision["prefill"], decision["decode"]) == (2, 1)
        assert decision["reason"].startswith(f"slo: prefill up 1->2: queue of {QUEUE_TOKENS} tokens"), decision["reason"]
        assert decision["time"].endswith("Z")
        assert status["desiredReplicas"]["prefill"] == 2
        assert live(api, ROLES)["llm-prefill"]["spec"]["replicas"] == 2
        assert deployments(api)["llm-decode"] == 1
        assert ("default", "llm") in sources.asked
        assert desired_metric("llm", "prefill") == 2

        await asyncio.sleep(3)  # more decisions: the second replica is starting (not in the registry yet)
        assert deployments(api)["llm-prefill"] == 2
        assert live(api, CLUSTERS)["llm"]["status"]["lastDecision"]["prefill"] == 2


async def test_slo_mode_decisions_are_clamped_by_the_bounds(api, sources):
    """kmock emulates the API server. The same burst under prefill.maxReplicas 1 changes nothing: the bound
    holds and the reason says so."""
    queue_on_prefill(sources)
    spec = copy.deepcopy(SPEC)
    spec["prefill"]["maxReplicas"] = 1
    async with Operator(str(api.url), SloReplicas(observers=sources.observer)):
        resp = await api.post(CLUSTER_PATH, json=cluster_doc("capped", spec))
        assert resp.status == 200, await resp.text()
        await eventually(lambda: "slo: prefill" in live(api, CLUSTERS)["capped"]["status"]["lastDecision"]["reason"],
                         timeout=30, what="a law decision in status")
        decision = live(api, CLUSTERS)["capped"]["status"]["lastDecision"]
        assert decision["prefill"] == 1 and "(bounds)" in decision["reason"], decision
        assert deployments(api)["capped-prefill"] == 1


async def test_external_mode_exports_desired_replicas_and_applies_only_the_scale_subresource(api, sources):
    """kmock emulates the API server. In external mode the law's desired replicas are exported as
    splitserve_autoscaler_desired_replicas{cluster,role} (what KEDA reads); the Deployments follow only what is
    written on the SplitServeRoles' scale subresource."""
    queue_on_prefill(sources)
    spec = copy.deepcopy(SPEC) | {"autoscaling": {"mode": "external", "intervalSeconds": 1, "coldStartSeconds": 60}}
    async with Operator(str(api.url), SloReplicas(observers=sources.observer)):
        resp = await api.post(CLUSTER_PATH, json=cluster_doc("ext", spec))
        assert resp.status == 200, await resp.text()
        await eventually(lambda: desired_metric("ext", "prefill") == 2, timeout=30, what="the exported metric")
        assert desired_metric("ext", "decode") == 1
        assert deployments(api)["ext-prefill"] == 1  # nothing applied by the operator itself
        role_path = f"/apis/{ROLES.rsplit('/', 1)[0]}/namespaces/{NS}/splitserveroles/ext-prefill"
        await api.patch(role_path, json={"spec": {"replicas": 2}})  # what KEDA writes via /scale
        await eventually(lambda: deployments(api)["ext-prefill"] == 2, timeout=30, what="KEDA's number applied")
        reason = live(api, CLUSTERS)["ext"]["status"]["lastDecision"]["reason"]
        assert reason.startswith("external"), reason


async def test_keda_example_targets_the_roles_and_the_metric_the_operator_exports():
    """deploy/examples/keda: one ScaledObject per role of the llama-8b example (in external mode), scaling the
    SplitServeRoles the operator creates, within their bounds, on the exact metric and labels it exports."""
    import re
    from pathlib import Path

    import yaml

    from splitserve.autoscaler.actuator import DESIRED
    from splitserve.hosts.k8s.children import children, owner_reference
    from splitserve.hosts.k8s.reconcile import resource_of
    from splitserve.hosts.k8s.replicas import Observed, decide, spec_or_scale

    root = Path(__file__).resolve().parents[2]
    cluster = yaml.safe_load((root / "deploy/examples/gpu-llama-8b.yaml").read_text())
    cluster["spec"]["autoscaling"]["mode"] = "external"
    cluster["metadata"].update(namespace="serving", uid="u")
    resource = resource_of(cluster)
    made = children(resource, decide(resource.spec, spec_or_scale(resource.spec, Observed())), owner_reference(cluster))
    roles = {o["metadata"]["name"]: o for o in made if o["kind"] == "SplitServeRole"}
    objects = list(yaml.safe_load_all((root / "deploy/examples/keda/llama-8b-scaledobjects.yaml").read_text()))
    assert len(objects) == 2
    name, labels = DESIRED._name, DESIRED._labelnames  # what the operator exports
    assert labels == ("cluster", "role")
    for so in objects:
        assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
        target = so["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("splitserve.dev/v1alpha1", "SplitServeRole")
        assert target["name"] in roles
        role = target["name"].removeprefix(f"{resource.metadata.name}-")
        role_spec = resource.spec.role(role)
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == \
            (role_spec.min_replicas, role_spec.max_replicas)
        [trigger] = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["threshold"] == "1"
        query = trigger["metadata"]["query"]
        m = re.fullmatch(rf'max\({name}\{{cluster="([^"]+)",role="([^"]+)"\}}\)', query)
        assert m and m.groups() == (resource.metadata.name, role), query
