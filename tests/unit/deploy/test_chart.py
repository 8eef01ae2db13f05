"""The Helm chart, rendered and linted by Helm's own library (helm-python-sdk: Helm's Go SDK, no helm binary,
no cluster, no network): with its defaults (a CPU SmolLM2 cluster) and with the values files in ci/ (GPU,
external Redis with API keys, autoscaling external). Every rendered object validates against the Kubernetes 1.33
schemas (kubernetes-validate), the SplitServeCluster against the generated CRD; generated files are current."""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from splitserve.common.config import ClusterSpec, SLOSpec
from splitserve.common.config_file import json_schema
from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.chart_values import ChartValues
from splitserve.hosts.k8s.crd import cluster_crd
from unit.deploy.test_k8s_schema import admit

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "splitserve"
VALUES = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((CHART / "ci").glob("*.yaml"))}
CASES = {"defaults": {}, **VALUES}
MONITORING = "(.Capabilities.APIVersions.Has \"monitoring.coreos.com/v1\")"


def render(values: dict, chart: Path = CHART, namespace: str = "serving") -> list[dict]:
    with helm.Chart.load(str(chart)) as c:
        manifests = c.render(values, name="splitserve", namespace=namespace)
    return [d for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_generated_files_are_current():
    """CRDs, values.schema.json and deploy/'s copies come from one source each (`make k8s-generate`)."""
    spec = importlib.util.spec_from_file_location("generate", ROOT / "deploy" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    for path, text in generate.generated().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run `make k8s-generate`"


def test_values_schema_is_the_configuration_model():
    schema = json.loads((CHART / "values.schema.json").read_text())
    spec = schema["properties"]["cluster"]["properties"]["spec"]
    model = json_schema(ClusterSpec)
    assert {k: v for k, v in spec.items() if k != "description"} == {k: v for k, v in model.items() if k != "description"}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for values in CASES.values():  # Helm merges each file over the defaults
        merged = ChartValues.model_validate(_merge(defaults, values))
        assert merged.cluster.spec.decode.replicas >= 1


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


@pytest.mark.parametrize("case", CASES)
def test_strict_lint_passes(case):
    report = helm.lint(str(CHART), CASES[case], strict=True, kube_version="v1.33.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] > 1] == []


@pytest.mark.parametrize("bad,message", [
    ({"cluster": {"spec": {"decode": {"replicas": -1}}}}, "minimum"),
    ({"cluster": {"spec": {"router": {"prot": 8000}}}}, "prot"),
    ({"cluster": {"spec": {"redis": {"mode": "cloud"}}}}, "redis/mode': value must be one of"),
    ({"operator": {"clusterwide": True}}, "clusterwide"),
])
def test_values_schema_refuses_bad_values(bad, message):
    with helm.Chart.load(str(CHART)) as c, pytest.raises(helm.HelmError, match=message):
        c.validate_schema(bad)


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_is_valid_kubernetes_1_33(case):
    docs = render(CASES[case])
    kinds = by_kind(docs)
    for doc in docs:
        if doc["kind"] == "SplitServeCluster":
            _, errors = admit(cluster_crd(), doc)
            assert errors == [], errors
        else:
            kubernetes_validate.validate(doc, "1.33", strict=True)
    assert {"ServiceAccount", "Deployment", "SplitServeCluster"} <= set(kinds)
    assert "ServiceMonitor" not in kinds and "PrometheusRule" not in kinds  # no monitoring.coreos.com/v1 here


def test_default_install_is_a_cpu_smollm2_cluster_with_bundled_redis():
    kinds = by_kind(render({}))
    [cluster] = kinds["SplitServeCluster"]
    spec = ClusterSpec.model_validate(cluster["spec"])
    assert (spec.model.name, spec.model.device, spec.redis.mode) == ("smollm2", "cpu", "bundled")
    assert all("nvidia.com/gpu" not in json.dumps(r.resources) for r in (spec.prefill, spec.decode))
    assert cluster["metadata"]["name"] == "splitserve" and cluster["metadata"]["namespace"] == "serving"
    assert [r["kind"] for r in kinds["Role"]] == ["Role"] and "ClusterRole" not in kinds
    [operator] = kinds["Deployment"]
    assert operator["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "splitserve", "operator", "--namespace", "serving", "--resync-seconds", "30", "--health-port", "8080",
        "--metrics-port", "9090"]
    assert [s["metadata"]["name"] for s in kinds["Service"]] == ["splitserve-operator-metrics"]
    assert {p["metadata"]["name"] for p in kinds["NetworkPolicy"]} == \
        {"splitserve-gateway", "splitserve-workers", "splitserve-redis"}
    [dashboard] = kinds["ConfigMap"]
    assert json.loads(dashboard["data"]["splitserve.json"]) == json.loads((CHART / "dashboards/splitserve.json").read_text())


def test_gpu_values_are_the_gpu_example():
    example = yaml.safe_load((ROOT / "deploy/examples/gpu-llama-8b.yaml").read_text())
    assert VALUES["gpu-values"]["cluster"]["spec"] == example["spec"]
    [cluster] = by_kind(render(VALUES["gpu-values"]))["SplitServeCluster"]
    spec = ClusterSpec.model_validate(cluster["spec"])
    assert spec.decode.resources["limits"]["nvidia.com/gpu"] == 1 and spec.decode.replicas == 3
    assert (spec.ratio.min, spec.ratio.max) == (0.25, 1.0) and spec.kubernetes.host_ipc


def test_external_redis_with_api_keys():
    kinds = by_kind(render(VALUES["external-redis-values"]))
    [secret] = kinds["Secret"]
    assert secret["stringData"] == {"keys": "sk-team-a,sk-team-b"}
    [cluster] = kinds["SplitServeCluster"]
    assert cluster["spec"]["router"]["apiKeySecret"] == {"name": secret["metadata"]["name"], "key": "keys"}
    assert cluster["spec"]["redis"] == {"mode": "external", "urlSecret": {"name": "redis-url", "key": "url"}}


def test_api_keys_need_a_key():
    with pytest.raises(helm.HelmError, match="apiKeys.keys: give at least one key"):
        render({"apiKeys": {"create": True}})


def test_cluster_wide_operator_gets_a_cluster_role():
    kinds = by_kind(render(VALUES["autoscaling-external-values"]))
    assert "ClusterRole" in kinds and "ClusterRoleBinding" in kinds and "Role" not in kinds
    [operator] = kinds["Deployment"]
    assert "--all-namespaces" in operator["spec"]["template"]["spec"]["containers"][0]["command"]
    [cluster] = kinds["SplitServeCluster"]
    assert cluster["spec"]["autoscaling"]["mode"] == "external"


def test_rbac_is_least_privilege():
    """Exactly the kinds the operator touches, with the verbs it uses; nothing cluster-wide by default."""
    [role] = by_kind(render({}))["Role"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert not any("*" in x for rule in role["rules"] for k in ("apiGroups", "resources", "verbs") for x in rule[k])
    group = {"v1": ""}
    for kind in names.OWNED:
        g = group.get(kind.api_version, kind.api_version.split("/")[0])
        assert {(g, kind.plural, v) for v in ("list", "create", "patch", "delete")} <= granted, kind.kind
    assert {("splitserve.dev", "splitserveclusters", v) for v in ("get", "list", "watch", "patch")} <= granted
    assert ("", "pods", "patch") in granted  # a flipped pod's deletion cost
    assert ("", "secrets", "get") not in granted and not any(v in {"update", "deletecollection"} for *_, v in granted)


def test_network_policy_ports_are_the_models_defaults():
    policies = {p["metadata"]["name"]: p for p in by_kind(render({}))["NetworkPolicy"]}
    spec = ClusterSpec()
    assert policies["splitserve-gateway"]["spec"]["ingress"] == [{"ports": [{"port": spec.router.port,
                                                                             "protocol": "TCP"}]}]
    metrics = policies["splitserve-workers"]["spec"]["ingress"][1]["ports"]
    assert {p["port"] for p in metrics} == {spec.prefill.metrics_port, spec.decode.metrics_port}
    grpc = policies["splitserve-workers"]["spec"]["ingress"][2]["ports"]  # the operator's role flips
    assert {p["port"] for p in grpc} == {spec.prefill.port, spec.decode.port}


def monitored_chart(tmp_path: Path) -> Path:
    """The chart as Helm renders it where the monitoring.coreos.com/v1 API exists (the SDK renders offline)."""
    chart = tmp_path / "splitserve"
    shutil.copytree(CHART, chart)
    for name in ("servicemonitor.yaml", "prometheusrule.yaml"):
        path = chart / "templates" / name
        assert MONITORING in path.read_text()
        path.write_text(path.read_text().replace(MONITORING, "true"))
    return chart


def test_service_monitor_and_alert_rules_where_prometheus_operator_exists(tmp_path):
    values = {"cluster": {"spec": {"slo": {"ttftSeconds": 1.5, "itlSeconds": 0.05}}}}
    kinds = by_kind(render(values, monitored_chart(tmp_path)))
    monitors = {m["metadata"]["name"]: m for m in kinds["ServiceMonitor"]}
    assert sorted(monitors) == ["splitserve", "splitserve-operator"]  # the cluster's and the operator's
    monitor = monitors["splitserve"]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http", "metrics"]
    assert monitor["spec"]["selector"]["matchLabels"][names.CLUSTER_LABEL] == "splitserve"
    [rule] = kinds["PrometheusRule"]
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert exprs["SplitServeTTFTAboveSLO"].strip().endswith("> 1.5")
    assert exprs["SplitServeITLAboveSLO"].strip().endswith("> 0.05")
    # deploy/'s plain rules file is the same rules at the model's default SLOs.
    [default_rule] = by_kind(render({}, monitored_chart(tmp_path / "again")))["PrometheusRule"]
    plain = yaml.safe_load((ROOT / "deploy/prometheus/splitserve-rules.yaml").read_text())
    assert default_rule["spec"] == plain
    slo = SLOSpec()
    assert f"> {slo.ttft_seconds:g}" in json.dumps(plain)


METRIC_SOURCES = ("router/metrics.py", "splitserve/common/worker_metrics.py", "decode_worker/metrics.py",
                  "kv_transfer/metrics.py")


def metric_names() -> set[str]:
    """Every series name splitserve exports (counters get _total, histograms _bucket/_sum/_count), read from the
    metrics modules' source: the gateway's and the workers' live in different processes and share some names."""
    suffixes = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}
    out = set()
    for source in METRIC_SOURCES:
        for kind, name in re.findall(r"\b(Counter|Gauge|Histogram)\(\s*\"(splitserve_[a-z_]+)\"", (ROOT / source).read_text()):
            out |= {name + s for s in suffixes[kind]}
    return out


def test_dashboard_and_rules_name_only_real_metrics():
    known = metric_names()
    dashboard = (CHART / "dashboards/splitserve.json").read_text()
    rules = (CHART / "files/prometheus-rules.yaml").read_text()
    used = set(re.findall(r"\bsplitserve_[a-z_]+", dashboard + rules))
    assert used and used <= known, used - known
    panels = [p["title"] for p in json.loads(dashboard)["panels"]]
    for topic in ("Time to first token", "Inter-token latency", "Goodput", "Queue depth", "KV cache usage",
                  "KV transfer bandwidth", "Local-prefill fallbacks", "Replicas per role", "Prefill:decode ratio"):
        assert any(title.startswith(topic) for title in panels), topic


def test_notes_tell_how_to_reach_the_gateway():
    with helm.Chart.load(str(CHART)) as c:
        notes = c.render({}, name="splitserve", namespace="serving")["splitserve/templates/NOTES.txt"]
    assert "kubectl -n serving port-forward svc/splitserve-gateway 8000:8000" in notes
    assert "/v1/chat/completions" in notes and '"model": "smollm2"' in notes
