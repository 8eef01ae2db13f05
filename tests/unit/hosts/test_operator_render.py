"""The operator's plain functions, on hand-made specs: replica decisions and their clamps, the checks that make
a spec Degraded, the pods it renders (commands, drain grace, GPUs, shm, volumes, secrets; engine vllm's two
containers), the config every pod reads, the config hash that rolls pods, and the conditions' bookkeeping."""

from __future__ import annotations

import copy
import json
import math

import pytest
import yaml

from splitserve.common.config import ClusterResource
from splitserve.common.config_file import dump
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.checks import check
from splitserve.hosts.k8s.children import children, config_hash, owner_reference, rendered
from splitserve.hosts.k8s.pods import VLLM_SIDECAR_RESOURCES, worker_command
from splitserve.hosts.k8s.reconcile import contains, resource_of
from splitserve.hosts.k8s.replicas import (
    Observed,
    ReplicaDecision,
    Unrealisable,
    decide,
    spec_or_scale,
)
from splitserve.hosts.k8s.status import Condition, set_condition
from splitserve.vllm_engine.server import VllmPorts, command
from unit.hosts.test_k8s_commands import parse

GPU = {"limits": {"nvidia.com/gpu": 1}}


def resource(spec: dict, name: str = "llm") -> ClusterResource:
    return resource_of({"metadata": {"name": name, "namespace": "serving"}, "spec": spec})


def decision_for(spec: dict, observed: Observed | None = None) -> ReplicaDecision:
    r = resource(spec)
    return decide(r.spec, spec_or_scale(r.spec, observed or Observed()))


def objects(spec: dict, name: str = "llm") -> dict[tuple[str, str], dict]:
    r = resource(spec, name)
    decision = decide(r.spec, spec_or_scale(r.spec, Observed()))
    owner = owner_reference({"metadata": {"name": name, "uid": "u"}})
    return {(o["kind"], o["metadata"]["name"]): o for o in children(r, decision, owner)}


def pod(objs: dict, component: str) -> dict:
    return objs[("Deployment", f"llm-{component}")]["spec"]["template"]["spec"]


# -- replicas -----------------------------------------------------------------------------------------------
def test_manual_mode_applies_spec_replicas():
    assert decision_for({"decode": {"replicas": 3}}) == ReplicaDecision(1, 3, "manual: spec replicas")


def test_ratio_bounds_clamp_and_say_so():
    d = decision_for({"decode": {"replicas": 8}, "ratio": {"min": 0.25}})
    assert (d.prefill, d.decode) == (2, 8)
    assert "asked prefill 1, decode 8" in d.reason and "ratio.min 0.25" in d.reason


def test_external_mode_takes_the_scale_subresource_clamped_to_max():
    spec = {"autoscaling": {"mode": "external"}, "decode": {"maxReplicas": 4}}
    d = decision_for(spec, Observed(role_replicas={"prefill": 2, "decode": 9}))
    assert d.decode == 4 and 1 <= d.prefill <= 2  # autoscaler.bounds.clamp picks the pair
    assert d.reason.startswith("external") and "decode.maxReplicas 4" in d.reason


def test_colocated_has_no_prefill_pool():
    objs = objects({"mode": "colocated", "decode": {"replicas": 2}})
    assert decision_for({"mode": "colocated", "decode": {"replicas": 2}}).prefill == 0
    assert ("Deployment", "llm-prefill") not in objs and ("SplitServeRole", "llm-prefill") not in objs
    assert pod(objs, "decode")["containers"][0]["command"][5] == "both"


@pytest.mark.parametrize("spec,reason,words", [
    ({"prefill": {"minReplicas": 2, "replicas": 2}, "decode": {"minReplicas": 2, "replicas": 2},
      "autoscaling": {"gpuBudget": 3}}, "GPUBudgetTooSmall", "need 4"),
    ({"prefill": {"maxReplicas": 1}, "decode": {"minReplicas": 8, "maxReplicas": 8, "replicas": 8},
      "ratio": {"min": 0.5}}, "RatioBoundsUnsatisfiable", "prefill 0..1"),
])
def test_bounds_no_pair_can_meet_are_unrealisable(spec, reason, words):
    with pytest.raises(Unrealisable) as e:
        decision_for(spec)
    assert e.value.reason == reason and words in e.value.message


# -- checks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,reason", [
    ({"redis": {"mode": "external"}}, "RedisURLMissing"),
    ({"model": {"tensorParallelSize": 2}}, "ShardedDisaggregationUnsupported"),
    ({"mode": "colocated", "model": {"tensorParallelSize": 2}, "decode": {"resources": GPU}}, "GPUCountMismatch"),
    ({"engine": "vllm", "mode": "colocated", "decode": {"engine": {"dataParallelSize": 2}, "resources": GPU}},
     "GPUCountMismatch"),
])
def test_valid_but_unrealisable_specs(spec, reason):
    with pytest.raises(Unrealisable) as e:
        check(resource(spec))
    assert e.value.reason == reason


def test_engine_vllm_disaggregates_sharded_workers_and_counts_data_parallel_gpus():
    """vLLM's NIXL pull joins prefill and decode of any tensor-parallel size; its pods ask for TP x DP GPUs."""
    two = {"limits": {"nvidia.com/gpu": 2}}
    check(resource({"engine": "vllm", "model": {"tensorParallelSize": 2, "device": "cuda"},
                    "prefill": {"resources": two}, "decode": {"resources": two}}))
    check(resource({"engine": "vllm", "mode": "colocated", "model": {"device": "cuda"},
                    "decode": {"engine": {"dataParallelSize": 2}, "resources": two}}))


def test_a_name_services_cannot_carry_is_unrealisable():
    with pytest.raises(Unrealisable, match="DNS label"):
        check(resource({}, name="1llm"))


def test_an_invalid_spec_is_unrealisable_not_a_crash():
    with pytest.raises(Unrealisable) as e:
        resource({"decode": {"engine": {"kvCacheMemory": "lots"}}})
    assert e.value.reason == "InvalidSpec" and "kvCacheMemory" in e.value.message


# -- pods ---------------------------------------------------------------------------------------------------
def test_worker_pods_drain_on_sigterm_with_grace_from_drain_seconds():
    objs = objects({"decode": {"drainSeconds": 90.5}})
    assert pod(objs, "decode")["terminationGracePeriodSeconds"] == 91 + names.DRAIN_MARGIN_SECONDS
    assert pod(objs, "prefill")["terminationGracePeriodSeconds"] == 120 + names.DRAIN_MARGIN_SECONDS


def test_worker_pod_probes_resources_and_downward_api():
    objs = objects({"decode": {"resources": {"limits": {"nvidia.com/gpu": 1, "rdma/ib": 1}}},
                    "model": {"device": "cuda"}})
    worker = pod(objs, "decode")["containers"][0]
    # GPUs and RDMA devices as given; cpu and memory completed (a request and a limit: ResourceQuotas admit it)
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": 1, "rdma/ib": 1, "cpu": "1", "memory": "4Gi"},
                                   "requests": {"cpu": "1", "memory": "4Gi"}}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == {"grpc": 50051, "metrics": 9100}
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert worker["command"][-4:] == ["--name", "$(POD_NAME)", "--advertise-host", "$(POD_IP)"]


def test_nixl_needs_host_ipc_and_shm_when_asked():
    objs = objects({"kubernetes": {"hostIpc": True, "shmSize": "16Gi"}})
    spec = pod(objs, "prefill")
    assert spec["hostIPC"] is True
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in spec["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
    assert "hostIPC" not in pod(objs, "gateway")


def test_embedded_model_is_fetched_by_an_init_container_into_the_workers_cache():
    objs = objects({})
    for component in ("prefill", "decode"):
        spec = pod(objs, component)
        [init] = spec["initContainers"]
        assert init["command"] == ["splitserve", "fetch-model", "smollm2"]
        assert init["image"] == "ghcr.io/splitserve/worker:0.1.0"  # torch converts the GGUF
        assert {"name": "SPLITSERVE_CACHE", "value": names.CACHE_DIR} in spec["containers"][0]["env"]
        assert init["resources"] == {side: {k: v for k, v in values.items() if k in ("cpu", "memory")}
                                     for side, values in spec["containers"][0]["resources"].items()}
    assert "initContainers" not in pod(objects({"model": {"name": "/models/llama"}}), "decode")


@pytest.mark.parametrize("spec", [{}, {"model": {"name": "/models/llama", "tokenizer": "smollm2"}},
                                  {"mode": "colocated", "redis": {"mode": "bundled"}}])
def test_the_gateway_pod_never_pulls_the_worker_image(spec):
    """The gateway image carries the embedded model's tokenizer (the Dockerfile's tokenizer stage), in the cache
    directory its pod names: no init container, no worker image, no shared cache volume."""
    gateway = pod(objects(spec), "gateway")
    images = {c["image"] for c in gateway.get("initContainers", []) + gateway["containers"]}
    assert images == {"ghcr.io/splitserve/gateway:0.1.0"} and "initContainers" not in gateway
    assert {"name": "SPLITSERVE_CACHE", "value": names.GATEWAY_CACHE_DIR} in gateway["containers"][0]["env"]
    assert all(v["name"] != "cache" for v in gateway["volumes"])


def test_every_container_has_cpu_and_memory_requests_and_limits():
    objs = objects({"redis": {"mode": "bundled"}, "kvPool": {"enabled": True, "maxMemory": "2gb"},
                    "prefill": {"resources": {"requests": {"cpu": "2", "memory": "8Gi"}}},
                    "router": {"resources": {"limits": {"cpu": "2"}}}})
    prefill = pod(objs, "prefill")["containers"][0]["resources"]
    assert prefill == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
    gateway = pod(objs, "gateway")["containers"][0]["resources"]
    assert gateway == {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "1Gi"}}
    redis = objs[("StatefulSet", "llm-redis")]["spec"]["template"]["spec"]["containers"][0]
    # maxmemory as `splitserve up` gives it, and a memory limit above it (2 GiB * 1.25 + 128 MiB)
    assert redis["args"][redis["args"].index("--maxmemory") + 1] == "2gb"
    assert redis["resources"]["limits"] == {"cpu": "1", "memory": "2688Mi"} == {
        "cpu": "1", "memory": redis["resources"]["requests"]["memory"]}


def test_pod_level_settings_from_the_spec():
    objs = objects({
        "decode": {"nodeSelector": {"gpu": "h200"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                   "affinity": {"nodeAffinity": {"x": 1}}},
        "kubernetes": {"imagePullSecrets": [{"name": "regcred"}], "podAnnotations": {"a": "1"},
                       "podLabels": {"team": "ml", names.CLUSTER_LABEL: "other"}, "priorityClassName": "high",
                       "nodeSelector": {"pool": "serving"}, "tolerations": [{"key": "serving", "operator": "Exists"}],
                       "affinity": {"podAntiAffinity": {"y": 2}},
                       "podSecurityContext": {"fsGroup": 10001, "runAsUser": 20000},
                       "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}}},
        "redis": {"mode": "bundled"}})
    templates = {c: objs[(k, f"llm-{c}")]["spec"]["template"] for k, c in
                 [("Deployment", "prefill"), ("Deployment", "decode"), ("Deployment", "gateway"),
                  ("StatefulSet", "redis")]}
    for component, template in templates.items():
        meta, spec = template["metadata"], template["spec"]
        assert meta["labels"]["team"] == "ml" and meta["labels"][names.CLUSTER_LABEL] == "llm"  # ours win
        assert meta["annotations"]["a"] == "1"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["priorityClassName"] == "high"
        assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 20000, "runAsGroup": 10001,
                                           "seccompProfile": {"type": "RuntimeDefault"}, "fsGroup": 10001}
        assert spec["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}
        expected = {"pool": "serving", "gpu": "h200"} if component == "decode" else {"pool": "serving"}
        assert spec["nodeSelector"] == expected, component
    decode, gateway = templates["decode"]["spec"], templates["gateway"]["spec"]
    assert [t["key"] for t in decode["tolerations"]] == ["serving", "gpu"]
    assert decode["affinity"] == {"nodeAffinity": {"x": 1}} and gateway["affinity"] == {"podAntiAffinity": {"y": 2}}


def test_model_volume_is_mounted_read_only_in_workers_and_gateways():
    objs = objects({"model": {"name": "/models/llama"},
                    "kubernetes": {"modelVolume": {"persistentVolumeClaim": {"claimName": "llama"}}}})
    for component in ("prefill", "gateway"):
        spec = pod(objs, component)
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "llama"}} in spec["volumes"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]


def test_secrets_become_environment_variables():
    objs = objects({"redis": {"mode": "external", "urlSecret": {"name": "r", "key": "url"}},
                    "router": {"apiKeySecret": {"name": "keys", "key": "k"}}})
    gateway_env = pod(objs, "gateway")["containers"][0]["env"]
    assert {"name": "SPLITSERVE_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}}} in gateway_env
    for component in ("prefill", "decode", "gateway"):
        assert {"name": "SPLITSERVE_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "r", "key": "url"}}} \
            in pod(objs, component)["containers"][0]["env"]
    assert ("StatefulSet", "llm-redis") not in objs


def test_bundled_redis_objects_and_url():
    objs = objects({"redis": {"mode": "bundled"}})
    assert objs[("Service", "llm-redis")]["spec"]["ports"][0]["port"] == 6379
    assert objs[("StatefulSet", "llm-redis")]["spec"]["replicas"] == 1
    config = ClusterResource.model_validate(yaml.safe_load(objs[("ConfigMap", "llm-config")]["data"]["cluster.yaml"]))
    assert (config.spec.redis.mode, config.spec.redis.url) == ("bundled", "redis://llm-redis:6379/0")
    assert config.spec.membership.decode == []


def test_without_redis_the_pools_are_reached_through_their_services():
    r = resource({})
    spec = rendered(r, ReplicaDecision(1, 1, "x")).spec
    assert (spec.membership.prefill, spec.membership.decode) == (["llm-prefill:50061"], ["llm-decode:50051"])


def test_gateway_service_type_and_pdbs():
    objs = objects({"kubernetes": {"gatewayServiceType": "LoadBalancer"}})
    assert objs[("Service", "llm-gateway")]["spec"]["type"] == "LoadBalancer"
    for component in ("prefill", "decode", "gateway"):
        pdb = objs[("PodDisruptionBudget", f"llm-{component}")]["spec"]
        assert pdb == {"maxUnavailable": 1, "selector": {"matchLabels": names.selector("llm", component)}}


def test_every_object_is_owned_and_labelled():
    for obj in objects({"redis": {"mode": "bundled"}}).values():
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [{"apiVersion": "splitserve.dev/v1alpha1", "kind": "SplitServeCluster",
                                            "name": "llm", "uid": "u", "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "splitserve-operator"
        assert meta["labels"][names.CLUSTER_LABEL] == "llm" and meta["namespace"] == "serving"


# -- engine vllm: the server beside the worker ----------------------------------------------------------------
VLLM = {"engine": "vllm", "model": {"name": "/models/qwen", "device": "cuda"},
        "kubernetes": {"modelVolume": {"persistentVolumeClaim": {"claimName": "qwen"}}},
        "prefill": {"resources": GPU}, "decode": {"resources": {"requests": {"cpu": "8", "memory": "64Gi"}, **GPU}}}
VLLM_IMAGE = "docker.io/vllm/vllm-openai:v0.26.0"


def containers(objs: dict, component: str) -> dict[str, dict]:
    return {c["name"]: c for c in pod(objs, component)["containers"]}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_a_vllm_worker_pod_runs_the_server_with_the_gpu_and_the_worker_beside_it(component):
    objs = objects(VLLM)
    spec = pod(objs, component)
    assert [c["name"] for c in spec["containers"]] == ["worker", "vllm"]  # the worker stays kubectl's default
    worker, server = spec["containers"]
    assert (worker["image"], server["image"]) == ("ghcr.io/splitserve/worker:0.1.0", VLLM_IMAGE)
    # the role's resources, GPUs included, are the server's; the worker relays on a little cpu and memory
    role = resource(VLLM).spec.role(component)
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1 and "nvidia.com/gpu" not in json.dumps(worker)
    assert server["resources"]["requests"]["memory"] == ("64Gi" if component == "decode" else "4Gi")
    assert worker["resources"] == VLLM_SIDECAR_RESOURCES
    # the worker attaches to the server over loopback; its probes are the native worker's
    assert worker["command"] == [*worker_command(component), "--engine", "vllm", "--vllm-url", "http://127.0.0.1:8200"]
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # the server's command line is vllm_engine.server's, on the model volume, its KV events on loopback
    ports = VllmPorts(8200, 5557, 5600)
    assert server["command"] == command(resource(VLLM).spec, component, "/models/qwen", ports, python="python3")
    assert flag(server["command"], "--host") == "127.0.0.1" and flag(server["command"], "--model") == "/models/qwen"
    assert json.loads(flag(server["command"], "--kv-events-config"))["endpoint"] == "tcp://127.0.0.1:5557"
    transfer = json.loads(flag(server["command"], "--kv-transfer-config"))  # vllm.connector: layerwise
    assert transfer["kv_connector"] == "SplitserveLayerwiseConnector"
    # its control line is the worker's, on loopback inside the pod; its metadata is served at the side channel
    assert transfer["kv_connector_extra_config"]["splitserve_layerwise"]["control"] == "tcp://127.0.0.1:5558"
    # ... and the stock image imports it from the files an init container copies
    assert {"name": "PYTHONPATH", "value": "/opt/splitserve/python"} in server["env"]
    assert "pool-connector" in {c["name"] for c in pod(objects(VLLM), component)["initContainers"]}
    # the NIXL handshake is on the pod's IP (the downward API), at the side-channel port it declares
    env = {e["name"]: e for e in server["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                                                  "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
    assert server["ports"] == [{"name": "nixl", "containerPort": 5600, "protocol": "TCP"}]
    # a memory-backed /dev/shm for the server only; HOME and /tmp writable under the read-only root
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in spec["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in server["volumeMounts"]
    assert all(m["name"] != "shm" for m in worker["volumeMounts"])
    assert env["HOME"]["value"] == "/tmp" and {"name": "vllm-tmp", "mountPath": "/tmp"} in server["volumeMounts"]
    assert {"name": "vllm-tmp", "emptyDir": {}} in spec["volumes"] and env["USER"]["value"]
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    for container in (worker, server):
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    # nothing to fetch (the model is on the volume); only the layerwise connector's files to copy
    assert [c["name"] for c in spec["initContainers"]] == ["pool-connector"]
    assert spec["terminationGracePeriodSeconds"] == math.ceil(role.drain_seconds) + names.DRAIN_MARGIN_SECONDS


def test_the_vllm_servers_probes_reach_its_loopback_and_cover_its_startup():
    objs = objects({**VLLM, "vllm": {"startupSeconds": 1805, "port": 8300}, "decode": {"drainSeconds": 45}})
    server = containers(objs, "decode")["vllm"]
    for probe in ("startupProbe", "livenessProbe"):  # an httpGet would be sent to the pod's IP, not loopback
        assert "httpGet" not in server[probe]
        assert "http://127.0.0.1:8300/health" in server[probe]["exec"]["command"][-1]
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1805
    assert startup["periodSeconds"] * (startup["failureThreshold"] - 1) < 1805
    assert server["livenessProbe"]["failureThreshold"] == 3
    assert containers(objs, "decode")["worker"]["command"][-1] == "http://127.0.0.1:8300"
    # on SIGTERM the server waits (up to drainSeconds) for the worker draining through it
    [_, _, wait] = server["lifecycle"]["preStop"]["exec"]["command"]
    assert "http://127.0.0.1:9100/healthz" in wait and "+ 45\n" in wait
    compile(wait, "preStop", "exec")


def test_the_vllm_sidecars_command_parses_with_the_worker_cli(tmp_path):
    objs = objects(VLLM)
    config = tmp_path / names.CONFIG_FILE
    config.write_text(objs[("ConfigMap", "llm-config")]["data"][names.CONFIG_FILE])
    worker = containers(objs, "decode")["worker"]
    ctx = parse([a.replace(names.CONFIG_PATH, str(config)) for a in worker["command"]], {"POD_IP": "10.0.0.7"})
    assert (ctx.params["engine"], ctx.params["vllm_url"], ctx.params["role"]) == ("vllm", "http://127.0.0.1:8200", "decode")


def test_a_colocated_vllm_cluster_has_no_kv_transfer_and_serves_the_embedded_model_from_the_cache():
    objs = objects({"mode": "colocated", "decode": {"engine": {"kind": "vllm", "vllmArgs": ["--quantization", "fp8"]},
                                                    "resources": GPU}})
    spec = pod(objs, "decode")
    worker, server = spec["containers"]
    assert worker["command"][5] == "both" and server["name"] == "vllm"
    assert "--kv-transfer-config" not in server["command"] and server["command"][-2:] == ["--quantization", "fp8"]
    assert not any(e["name"].startswith(("VLLM_NIXL", "UCX")) for e in server["env"]) and "ports" not in server
    # the init container converts the embedded model into the pod's cache; the server reads it there
    [init] = spec["initContainers"]
    assert init["command"] == ["splitserve", "fetch-model", "smollm2"]
    assert flag(server["command"], "--model") == f"{names.CACHE_DIR}/models/smollm2"
    assert {"name": "cache", "mountPath": names.CACHE_DIR, "readOnly": True} in server["volumeMounts"]
    assert flag(server["command"], "--served-model-name") == "smollm2"
    assert init["resources"] == {side: {k: v for k, v in values.items() if k in ("cpu", "memory")}
                                 for side, values in server["resources"].items()}


def test_device_auto_is_decided_by_the_pods_gpus_not_the_operators_host():
    """This host has no GPU: vllm_engine.server alone would take auto for cpu."""
    gpu = containers(objects({**VLLM, "model": {"name": "/models/qwen"}, "vllm": {"connector": "pull"}}),
                     "decode")["vllm"]
    assert "--enforce-eager" not in gpu["command"] and not any(e["name"].startswith("VLLM_CPU") for e in gpu["env"])
    assert json.loads(flag(gpu["command"], "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
    cpu = containers(objects({"engine": "vllm", "vllm": {"connector": "pull"}}), "decode")["vllm"]
    assert "--enforce-eager" in cpu["command"] and {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"} in cpu["env"]
    assert json.loads(flag(cpu["command"], "--kv-transfer-config"))["kv_buffer_device"] == "cpu"


def test_kubernetes_shm_size_sizes_the_vllm_servers_shm():
    objs = objects({**VLLM, "kubernetes": {"shmSize": "4Gi", "hostIpc": True}})
    spec = pod(objs, "prefill")
    assert [v for v in spec["volumes"] if v["name"] == "shm"] == [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]
    assert spec["hostIPC"] is True


@pytest.mark.parametrize("spec", [{}, {"mode": "colocated"}, {"kubernetes": {"shmSize": "1Gi"}}])
def test_a_native_cluster_renders_one_worker_container(spec):
    objs = objects(spec)
    for component in ("decode",) if spec.get("mode") == "colocated" else ("prefill", "decode"):
        [worker] = pod(objs, component)["containers"]
        assert worker["name"] == "worker" and worker["command"] == worker_command(worker["command"][5])
        assert "--vllm-url" not in worker["command"] and "vllm" not in json.dumps(pod(objs, component))


# -- config hash ------------------------------------------------------------------------------------------
def test_config_hash_rolls_pods_on_engine_changes_not_on_scaling():
    r = resource({})
    base = config_hash(dump(rendered(r, ReplicaDecision(1, 1, "x"))))
    scaled = resource({"decode": {"replicas": 4, "maxReplicas": 10}, "ratio": {"min": 0.25}})
    assert config_hash(dump(rendered(scaled, ReplicaDecision(1, 4, "x")))) == base
    tuned = resource({"decode": {"engine": {"maxNumSeqs": 64}}})
    assert config_hash(dump(rendered(tuned, ReplicaDecision(1, 1, "x")))) != base


# -- applying and status ------------------------------------------------------------------------------------
def test_contains_tolerates_server_defaults_and_quantities():
    wanted = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": 1}}}]}}}}
    live = copy.deepcopy(wanted)
    live["spec"]["strategy"] = {"type": "RollingUpdate"}
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    assert contains(live, wanted)
    live["spec"]["replicas"] = 3
    assert not contains(live, wanted)


def test_conditions_keep_their_transition_time_until_they_flip():
    first = set_condition([], "Ready", False, "ReplicasNotReady", "waiting", 1)
    old = first[0].model_copy(update={"last_transition_time": "2020-01-01T00:00:00Z"})
    again = set_condition([old], "Ready", False, "ReplicasNotReady", "still waiting", 2)
    assert again[0].last_transition_time == "2020-01-01T00:00:00Z" and again[0].observed_generation == 2
    flipped = set_condition(again, "Ready", True, "AllReplicasReady", "", 2)
    assert flipped[0].last_transition_time != "2020-01-01T00:00:00Z"
    both = set_condition(flipped, "Degraded", False, "AsExpected", "", 2)
    assert [c.type for c in both] == ["Ready", "Degraded"] and isinstance(both[0], Condition)
