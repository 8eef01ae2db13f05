"""Every container the chart or the operator creates (the operator's Deployment, gateways, workers, their init
containers, the bundled Redis) meets the `restricted` Pod Security Standard and splitserve's own rules (tests/support/pss.py,
rule by rule): for every chart install in ci/ and every example, the objects as Helm renders them and as
`splitserve render` prints the operator's. The one documented exception is `kubernetes.hostIpc: true` (NIXL over
shared memory between pods), which only the worker pods of a spec that asks for it carry."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from support.pss import pod_templates, violations

from unit.deploy.test_chart import CASES
from unit.deploy.test_chart import render as helm_render
from unit.splitserve.test_k8s_cli import EXAMPLES, chart_cluster, render, validate

HOST_IPC = "baseline/host namespaces: hostIPC is true"


def _check(objects: list[dict], host_ipc: bool) -> int:
    pods = 0
    for name, template in pod_templates(objects):
        is_worker = name.startswith("Deployment/") and name.endswith(("-prefill", "-decode"))
        expected = [HOST_IPC] if host_ipc and is_worker else []
        assert violations(template) == expected, name
        pods += 1
    return pods


@pytest.mark.parametrize("case", CASES)
def test_chart_and_operator_pods_are_restricted(case, tmp_path):
    chart = helm_render(CASES[case])
    assert _check(chart, host_ipc=False) == 1  # the operator
    [cluster] = [d for d in chart if d["kind"] == "SplitServeCluster"]
    host_ipc = bool((cluster["spec"].get("kubernetes") or {}).get("hostIpc"))
    assert _check(render(chart_cluster(case, tmp_path)), host_ipc) >= 2  # a worker pool and the gateway at least


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_pods_are_restricted(path):
    spec = yaml.safe_load(path.read_text())["spec"]
    assert _check(render(path), bool(spec.get("kubernetes", {}).get("hostIpc"))) >= 2


def test_bundled_redis_and_every_init_container_are_checked(tmp_path):
    doc = {"apiVersion": "splitserve.dev/v1alpha1", "kind": "SplitServeCluster", "metadata": {"name": "llm"},
           "spec": {"redis": {"mode": "bundled"}, "model": {"name": "smollm2"}}}
    path = tmp_path / "llm.yaml"
    path.write_text(yaml.safe_dump(doc))
    objects = render(path)
    names = {name for name, _ in pod_templates(objects)}
    assert names == {"StatefulSet/llm-redis", "Deployment/llm-prefill", "Deployment/llm-decode",
                     "Deployment/llm-gateway"}
    assert sum(len(t["spec"].get("initContainers", [])) for _, t in pod_templates(objects)) == 2
    _check(objects, host_ipc=False)



def test_vllm_worker_pods_are_restricted_and_valid(tmp_path):
    """Engine vllm: both containers of each worker pod (the stock vLLM image, run as the pod's user under a
    read-only root, and the worker beside it) keep to the standard, and the pods are valid Kubernetes 1.33."""
    gpu = {"limits": {"nvidia.com/gpu": 1}}
    doc = {"apiVersion": "splitserve.dev/v1alpha1", "kind": "SplitServeCluster", "metadata": {"name": "llm"},
           "spec": {"engine": "vllm", "prefill": {"resources": gpu}, "decode": {"resources": gpu},
                    "kubernetes": {"shmSize": "8Gi"}}}
    path = tmp_path / "llm.yaml"
    path.write_text(yaml.safe_dump(doc))
    objects = render(path)
    workers = [t for name, t in pod_templates(objects) if name.endswith(("-prefill", "-decode"))]
    assert len(workers) == 2
    assert all([c["name"] for c in t["spec"]["containers"]] == ["worker", "vllm"] for t in workers)
    assert _check(objects, host_ipc=False) == 3  # the gateway too
    for obj in objects:
        validate(obj)


GOOD = {"metadata": {}, "spec": {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
    "volumes": [{"name": "tmp", "emptyDir": {}}],
    "containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                                            "limits": {"cpu": "1", "memory": "1Gi"}},
                    "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}}]}}


def _bad(**changes: object) -> dict:
    pod = copy.deepcopy(GOOD)
    for path, value in changes.items():
        node = pod
        *parents, last = path.split("__")
        for key in parents:
            node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
        node[last] = value
    return pod


@pytest.mark.parametrize("changes,rule", [
    ({"spec__hostNetwork": True}, "baseline/host namespaces"),
    ({"spec__volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
     {"baseline/hostPath volumes", "restricted/volume types"}),  # not a volume type restricted allows either
    ({"spec__containers__0__securityContext__privileged": True}, "baseline/privileged"),
    ({"spec__containers__0__ports": [{"containerPort": 80, "hostPort": 80}]}, "baseline/host ports"),
    ({"spec__containers__0__securityContext__procMount": "Unmasked"}, "baseline/proc mount"),
    ({"spec__securityContext__sysctls": [{"name": "kernel.msgmax", "value": "1"}]}, "baseline/sysctls"),
    ({"spec__securityContext__seLinuxOptions": {"type": "spc_t"}}, "baseline/SELinux"),
    ({"spec__containers__0__securityContext__appArmorProfile": {"type": "Unconfined"}}, "baseline/AppArmor"),
    ({"spec__volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}, "restricted/volume types"),
    ({"spec__containers__0__securityContext__allowPrivilegeEscalation": True}, "restricted/privilege escalation"),
    ({"spec__securityContext__runAsNonRoot": False}, "restricted/running as non-root"),
    ({"spec__containers__0__securityContext__runAsUser": 0}, "restricted/running as non-root user"),
    ({"spec__securityContext__seccompProfile": {"type": "Unconfined"}}, "restricted/seccomp"),
    ({"spec__containers__0__securityContext__capabilities": {"drop": ["NET_RAW"]}}, "restricted/capabilities"),
    ({"spec__containers__0__securityContext__capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}},
     "restricted/capabilities"),
    ({"spec__securityContext__runAsUser": None}, "splitserve/numeric user"),
    ({"spec__containers__0__securityContext__readOnlyRootFilesystem": False}, "splitserve/read-only root"),
    ({"spec__containers__0__resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}, "splitserve/resources"),
    ({"spec__initContainers": [{**GOOD["spec"]["containers"][0], "name": "init",
                                "securityContext": {"readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}}]},
     "restricted/privilege escalation"),
])
def test_each_rule_fails_a_pod_that_breaks_it(changes, rule):
    """The checker itself: a good pod passes, and each change breaks exactly the rule it targets."""
    assert violations(GOOD) == []
    found = violations(_bad(**changes))
    assert found and {v.split(":")[0] for v in found} == ({rule} if isinstance(rule, str) else rule), found


def test_the_chart_operator_pod_values_reach_its_pod():
    values = yaml.safe_load((Path(__file__).resolve().parents[3] / "charts/splitserve/ci/private-registry-values.yaml")
                            .read_text())
    [operator] = [d for d in helm_render(values) if d["kind"] == "Deployment"]
    pod = operator["spec"]["template"]
    assert pod["metadata"]["annotations"] == values["operator"]["podAnnotations"]
    assert pod["metadata"]["labels"]["example.com/cost-center"] == "ml"
    spec = pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["priorityClassName"] == "platform-critical"
    assert spec["tolerations"] == values["operator"]["tolerations"] and spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["containers"][0]["image"] == values["operator"]["image"]
