"""Every actuator applies a decision's role flip: `splitserve up --autoscale`'s (the launcher's bookkeeping follows,
nothing starts or stops), the operator's (kopf and the kubernetes client for real against kmock's emulator,
which stands in for the API server: each Deployment sized for the pods it holds, the flipped pod's deletion
cost, the SplitServeRoles' status listing which pods serve which role) and Ray Serve's policy (each deployment
sized for the replicas it holds, the placement in its policy state). The registry is a real redis-server; the
workers are hand-made handlers behind the real gRPC adapter whose flip rewrites their registry entry as a
worker's does (tests/e2e/test_role_flip_serving.py flips a real one). The decisions are hand-made: the law that
plans flips is tested on its own (tests/unit/autoscaler/test_autoscaler_law_flips.py); here only their application is."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import kmock as km
import kopf
import pytest
from unit.hosts.test_operator_kmock import (
    CLUSTERS,
    DEPLOYMENTS,
    NS,
    ROLES,
    VERBS,
    cluster_doc,
    eventually,
    live,
    serve_cluster_api,
)
from unit.router.test_role_flip import MODEL, FlipHandler, serving

from splitserve.autoscaler.flips import RoleFlip
from splitserve.autoscaler.law import RoleDecision, ScalingDecision
from splitserve.autoscaler.law_state import ControllerState
from splitserve.autoscaler.observer import Observer
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import Keys, RegistryEntry
from splitserve.common.registry import Registration
from splitserve.hosts.common import Placement
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.kube import Kube
from splitserve.hosts.k8s.reconcile import Deps
from splitserve.hosts.k8s.replicas import Wanted
from splitserve.hosts.k8s.run import operate
from splitserve.hosts.local.autoscale import LocalAutoscaler

pytestmark = pytest.mark.slow

FLIP = RoleFlip("decode", "prefill", 1, "prefill needs one more; decode has one to spare", 5.0)


class Fleet:
    """Hand-made workers, each behind a real gRPC server and registered in Redis under its name, role and load."""

    def __init__(self) -> None:
        self.handlers: dict[str, FlipHandler] = {}
        self._closing: list[Any] = []

    @classmethod
    async def start(cls, redis_url: str, workers: dict[str, tuple[str, int]]) -> Fleet:
        fleet = cls()
        for name, (role, running) in workers.items():
            handler = FlipHandler(role)
            server, endpoint = await serving(handler)
            link = RedisLink(redis_url)
            await link.start()
            entry = RegistryEntry(name, f"{name}-i", role, MODEL, endpoint, "", 16, 100, num_running=running)
            handler.registration = Registration(link, Keys(MODEL), entry, lease_s=30.0)
            await handler.registration.start()
            fleet.handlers[name] = handler
            fleet._closing += [handler.registration, link, server]
        return fleet

    def roles(self) -> dict[str, str]:
        return {name: h.role for name, h in self.handlers.items()}

    async def close(self) -> None:
        for thing in self._closing:
            if isinstance(thing, Registration | RedisLink):
                await thing.close()
            else:
                await thing.stop(None)


def observer_of(redis_url: str) -> Observer:
    observer = Observer(redis_url, MODEL, [])
    observer.entries = observer.registry()
    return observer


def test_a_placement_counts_flipped_workers_where_they_serve_and_groups_where_they_live():
    entries = [RegistryEntry(n, "i", role, MODEL, "h:1", "", 16, 1) for n, role in
               (("p-0", "prefill"), ("d-0", "decode"), ("d-1", "prefill"), ("d-2", "decode"))]
    pool = {"p-0": "prefill", "d-0": "decode", "d-1": "decode", "d-2": "decode"}.get
    where = Placement.of(entries, pool)
    assert where.serving == {"prefill": ["d-1", "p-0"], "decode": ["d-0", "d-2"]}
    assert where.flipped_in == {"prefill": ["d-1"], "decode": []} and where.flipped_out("decode") == ["d-1"]
    # 2 prefill and 2 decode serving: the prefill group holds 1 (d-1 lives in decode's), decode's holds 3
    assert (where.group_size("prefill", 2), where.group_size("decode", 2)) == (1, 3)
    back = where.moved(["d-1"], "prefill", "decode", pool)  # flipped back: nothing lives away from home
    assert back.flipped_in == {"prefill": [], "decode": []} and back.group_size("decode", 3) == 3
    assert where.as_status("prefill") == {"servingPods": ["d-1", "p-0"], "flippedPods": ["d-1"]}


# -- splitserve up --autoscale ----------------------------------------------------------------------------------
class Processes:
    """Stands in for the launcher's process management (tested with real processes elsewhere): who serves which
    pool, and what the actuator asked it to start, drain or move."""

    def __init__(self, pools: dict[str, str]) -> None:
        self.pool_of = dict(pools)
        self.started: list[str] = []
        self.drained: list[str] = []

    def workers(self, pool: str) -> list[str]:
        return sorted(n for n, p in self.pool_of.items() if p == pool and n not in self.drained)

    def add_worker(self, pool: str) -> str:
        self.started.append(pool)
        return f"{pool}-new"

    def drain_worker(self, name: str) -> None:
        self.drained.append(name)

    def moved(self, name: str, pool: str) -> None:
        self.pool_of[name] = pool


def decision(prefill: int, decode: int, flip: RoleFlip | None) -> ScalingDecision:
    def role(name: str, desired: int) -> RoleDecision:
        return RoleDecision(name, desired, desired, "hold", "hand-made", 0.0, 0.0, 0.8)

    return ScalingDecision(0.0, role("prefill", prefill), role("decode", decode), (), ControllerState(), flip)


def test_up_autoscale_flips_the_least_loaded_decode_worker_before_it_starts_or_stops_any(redis):
    async def main() -> None:
        fleet = await Fleet.start(redis.url, {"prefill-0": ("prefill", 0), "decode-0": ("decode", 3),
                                              "decode-1": ("decode", 1)})
        try:
            processes = Processes({"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"})
            scaler = LocalAutoscaler(processes, autoscaler=None, observer=observer_of(redis.url))
            await asyncio.to_thread(scaler.apply, decision(2, 1, FLIP))
            assert fleet.roles() == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "prefill"}
            assert processes.pool_of["decode-1"] == "prefill"  # it counts in its new pool
            assert processes.started == [] and processes.drained == []  # the flip was the whole change
            entries = scaler.observer.registry()
            assert (entries["decode-1"].role, entries["decode-1"].draining) == ("prefill", False)

            # a flip that fails leaves the worker where it is, and a start makes up for it
            fleet.handlers["decode-0"].refuse = "a flip to prefill is under way"
            scaler.observer.entries = scaler.observer.registry()
            await asyncio.to_thread(scaler.apply, decision(3, 0, FLIP))
            assert processes.pool_of["decode-0"] == "decode" and processes.started == ["prefill"]
            assert processes.drained == ["decode-0"]
        finally:
            await fleet.close()

    asyncio.run(main())


# -- the operator -----------------------------------------------------------------------------------------------
PODS = "v1/pods"
SPEC = {"model": {"name": "smollm2", "device": "cuda"}, "redis": {"mode": "bundled"},
        "prefill": {"replicas": 1, "maxReplicas": 4}, "decode": {"replicas": 2, "maxReplicas": 4}}


class Provider:
    """The replica provider's answer, as the SLO law's would be: 2 prefill and 1 decode, by a flip (once)."""

    def __init__(self) -> None:
        self.flipped = False

    def __call__(self, spec: Any, observed: Any) -> Wanted:
        flip, self.flipped = (None if self.flipped else FLIP), True
        return Wanted(2, 1, "slo: hand-made, a flip", None, flip)


@pytest.fixture
def api(kmock: km.KubernetesEmulator) -> km.KubernetesEmulator:
    serve_cluster_api(kmock)
    kmock.resources[PODS] = km.ResourceInfo(kind="Pod", namespaced=True, verbs=VERBS)
    return kmock


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_flips_a_pod_and_sizes_each_deployment_for_the_pods_it_holds(api, redis):
    fleet = await Fleet.start(redis.url, {"llm-prefill-7f-a": ("prefill", 0), "llm-decode-5c-a": ("decode", 4),
                                          "llm-decode-5c-b": ("decode", 0)})
    for name in fleet.handlers:  # the pods the registry names (kmock runs no Deployment controller)
        resp = await api.post(f"/api/v1/namespaces/{NS}/pods", json={
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}})
        assert resp.status == 200, await resp.text()
    observer = Observer(redis.url, MODEL, [])
    stop = threading.Event()
    url = str(api.url).rstrip("/")

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url)

    deps = Deps(Kube.for_url(url), Provider(), registry=lambda namespace, cluster, spec: observer.registry())
    thread = threading.Thread(target=asyncio.run, args=(operate(deps, login, namespaces=[NS], resync_seconds=1.0,
                                                                stop_flag=stop),), daemon=True)
    thread.start()
    try:
        resp = await api.post(f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{NS}/splitserveclusters",
                              json=cluster_doc("llm", SPEC))
        assert resp.status == 200, await resp.text()
        await eventually(lambda: fleet.roles()["llm-decode-5c-b"] == "prefill", timeout=30,
                         what="the least loaded decode pod flipped")
        assert fleet.roles()["llm-decode-5c-a"] == "decode"  # the busier one stays

        def sized() -> bool:  # no pod starts or stops: each Deployment holds what it has
            got = {n: d["spec"]["replicas"] for n, d in live(api, DEPLOYMENTS).items()}
            return got == {"llm-gateway": 1, "llm-prefill": 1, "llm-decode": 2}

        await eventually(sized, timeout=30, what="Deployments sized for the pods they hold")
        roles = live(api, ROLES)
        assert (roles["llm-prefill"]["spec"]["replicas"], roles["llm-decode"]["spec"]["replicas"]) == (2, 1)

        def pods_listed() -> bool:  # each role's status is written in its own patch
            got = {n: r.get("status", {}).get("servingPods") for n, r in live(api, ROLES).items()}
            return got == {"llm-prefill": ["llm-decode-5c-b", "llm-prefill-7f-a"], "llm-decode": ["llm-decode-5c-a"]}

        await eventually(pods_listed, timeout=30, what="each role's pods in its status")
        prefill, decode = live(api, ROLES)["llm-prefill"]["status"], live(api, ROLES)["llm-decode"]["status"]
        assert prefill["flippedPods"] == ["llm-decode-5c-b"]
        assert decode["servingPods"] == ["llm-decode-5c-a"] and decode["flippedPods"] == []
        pod = live(api, PODS)["llm-decode-5c-b"]
        assert pod["metadata"]["annotations"][names.DELETION_COST_ANNOTATION] == "1000"
        assert "annotations" not in live(api, PODS)["llm-decode-5c-a"]["metadata"]
        assert live(api, CLUSTERS)["llm"]["status"]["desiredReplicas"]["prefill"] == 2
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
        observer.close()
        await fleet.close()


# -- Ray Serve --------------------------------------------------------------------------------------------------
def test_ray_s_policy_flips_a_replica_and_sizes_each_deployment_for_the_replicas_it_holds(redis):
    pytest.importorskip("ray.serve")
    from unit.hosts.test_ray_app import LOCAL, contexts

    from splitserve.common.config_file import load
    from splitserve.hosts.ray.policy import LawPolicy, policy_config

    class Law:  # the law's decision this call (`flip`), as the shared Autoscaler would return it
        def __init__(self, flip: RoleFlip | None) -> None:
            self.flip = flip

        def tick(self, expected: dict[str, int]) -> ScalingDecision:
            self.expected = expected
            return decision(2, 1, self.flip)

    async def main() -> None:
        fleet = await Fleet.start(redis.url, {"prefill-r1": ("prefill", 0), "decode-r2": ("decode", 0),
                                              "decode-r3": ("decode", 2)})
        try:
            resource = load(LOCAL, {"autoscaling.mode": "slo", "decode.max_replicas": 3, "redis.url": redis.url})
            observer = observer_of(redis.url)
            policy = LawPolicy(**policy_config(resource)["policy_kwargs"], observer=observer)
            policy.autoscaler = law = Law(FLIP)
            replicas, state = await asyncio.to_thread(policy, contexts({"prefill": 1, "decode": 2}, resource.spec))
            assert law.expected == {"prefill": 1, "decode": 2}
            assert {d.name: n for d, n in replicas.items()} == {"prefill": 1, "decode": 2}  # nothing starts
            await asyncio.to_thread(policy.flipping.join, 30)
            assert fleet.roles()["decode-r2"] == "prefill" and fleet.roles()["decode-r3"] == "decode"
            placed = {d.name: json.loads(s["splitserve"]) for d, s in state.items()}
            assert placed["prefill"]["servingPods"] == ["decode-r2", "prefill-r1"]
            assert placed["prefill"]["flippedPods"] == ["decode-r2"] and placed["decode"]["servingPods"] == ["decode-r3"]

            observer.entries = observer.registry()  # the next call counts the flipped replica where it serves
            policy.autoscaler = law = Law(None)
            replicas, _ = await asyncio.to_thread(policy, contexts({"prefill": 1, "decode": 2}, resource.spec))
            assert law.expected == {"prefill": 2, "decode": 1}
            assert {d.name: n for d, n in replicas.items()} == {"prefill": 1, "decode": 2}  # as they are
        finally:
            await fleet.close()

    asyncio.run(main())
