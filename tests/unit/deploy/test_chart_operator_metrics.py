"""The chart's wiring of the operator's metrics (the autoscaler's desired replicas, which KEDA/HPA read in external
mode): `--metrics-port` is the port the operator's Service and ServiceMonitor scrape, the rendered command line
parses with the real CLI, and the NetworkPolicies let the operator reach what its observer reads (the Redis and
gateway URLs `service_observer` builds, and the registered workers' metrics port) without opening anything else."""

from __future__ import annotations

from urllib.parse import urlsplit

import helm_python as helm
import pytest
from e2e.test_k8s_docs import operator_objects

from splitserve.hosts.k8s import names
from splitserve.hosts.k8s.reconcile import resource_of
from splitserve.hosts.k8s.slo import service_observer
from unit.deploy.test_chart import CASES, CHART, VALUES, by_kind, monitored_chart, render
from unit.hosts.test_k8s_commands import parse

NS = "serving"
METRICS_CASES = {**CASES, "metrics-port-9464": {"operator": {"metricsPort": 9464}}}


def operator_parts(docs: list[dict]) -> tuple[dict, dict]:
    """The operator's pod template and the Service of its metrics."""
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    [service] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "splitserve-operator-metrics"]
    return deployment["spec"]["template"], service


def container_port(pod: dict, target: int | str) -> int:
    """A Service's targetPort (a name or a number) as the pod's container port number."""
    ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    return next(p["containerPort"] for p in ports if target in (p["name"], p["containerPort"]))


@pytest.mark.parametrize("case", METRICS_CASES)
def test_metrics_port_is_what_the_service_targets_and_the_cli_parses(case):
    pod, service = operator_parts(render(METRICS_CASES[case]))
    want = METRICS_CASES[case].get("operator", {}).get("metricsPort", 9090)
    [container] = pod["spec"]["containers"]
    argv = container["command"]
    assert argv[argv.index("--metrics-port") + 1] == str(want)
    ctx = parse(argv, {e["name"]: e["value"] for e in container.get("env", [])})  # the real click command
    assert ctx.info_name == "operator" and ctx.params["metrics_port"] == want and ctx.params["health_port"] == 8080
    assert ctx.params["all_namespaces"] == bool(METRICS_CASES[case].get("operator", {}).get("clusterWide"))
    selector = service["spec"]["selector"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["port"] == want
    assert container_port(pod, port["targetPort"]) == ctx.params["metrics_port"]


def test_metrics_port_must_not_be_the_health_port():
    with pytest.raises(helm.HelmError, match="operator.metricsPort: 8080 is the operator's health port"):
        render({"operator": {"metricsPort": 8080}})


@pytest.mark.parametrize("create", [True, False])
def test_operator_service_monitor_scrapes_the_metrics_service(tmp_path, create):
    """Where the Prometheus Operator exists the operator gets a ServiceMonitor of its own (with or without a
    cluster in the release) that selects only its metrics Service, on the port named like the Service's."""
    docs = render({"cluster": {"create": create}}, monitored_chart(tmp_path))
    monitors = {m["metadata"]["name"]: m for m in by_kind(docs)["ServiceMonitor"]}
    monitor = monitors.pop("splitserve-operator")
    assert list(monitors) == (["splitserve"] if create else [])
    _, service = operator_parts(docs)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"]  # the metric's own `cluster` label is what KEDA's query selects on
    # Neither ServiceMonitor picks up the other's Services.
    services = [o for o in cluster_objects(docs) if o["kind"] == "Service"] if create else []
    for other in services:
        assert not monitor["spec"]["selector"]["matchLabels"].items() <= other["metadata"]["labels"].items()
    for cluster_monitor in monitors.values():
        assert not cluster_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


# -- NetworkPolicy, evaluated as the API server's semantics say (ingress only: the chart restricts nothing else) --

def selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e["values"]) \
                or (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def peer_matches(peer: dict, policy_ns: str, src_ns: str, src_labels: dict[str, str]) -> bool:
    if "ipBlock" in peer:
        return False
    ns_ok = (selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src_ns})
             if "namespaceSelector" in peer else src_ns == policy_ns)
    return ns_ok and selects(peer.get("podSelector", {}), src_labels)


def admitted(policies: list[dict], dst_labels: dict[str, str], port: int, src_ns: str,
             src_labels: dict[str, str]) -> bool:
    """Whether a pod (`src_ns`, `src_labels`) may open `port` on the pod `dst_labels` in NS."""
    applying = [p for p in policies if p["metadata"]["namespace"] == NS and "Ingress" in p["spec"]["policyTypes"]
                and selects(p["spec"]["podSelector"], dst_labels)]
    return not applying or any(
        (not rule.get("ports") or any(p["port"] == port for p in rule["ports"]))
        and (not rule.get("from") or any(peer_matches(peer, NS, src_ns, src_labels) for peer in rule["from"]))
        for policy in applying for rule in policy["spec"].get("ingress", []))


def cluster_objects(docs: list[dict]) -> list[dict]:
    [cluster] = [d for d in docs if d["kind"] == "SplitServeCluster"]
    return operator_objects(cluster)


def pods_behind(objects: list[dict], url: str) -> tuple[dict, int]:
    """The pod template a Service URL (`http://NAME.NS.svc:PORT`) reaches, and the container port it reaches."""
    parts = urlsplit(url)
    name, namespace = parts.hostname.split(".")[:2]
    assert namespace == NS
    [service] = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name]
    [port] = [p for p in service["spec"]["ports"] if p["port"] == parts.port]
    [pod] = [o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")
             and selects({"matchLabels": service["spec"]["selector"]}, o["spec"]["template"]["metadata"]["labels"])]
    return pod, container_port(pod, port["targetPort"])


@pytest.mark.parametrize("case", [c for c in METRICS_CASES if METRICS_CASES[c].get("networkPolicy", {})
                                  .get("enabled", True)])
@pytest.mark.parametrize("metrics_from", [None, [{"namespaceSelector": {"matchLabels": {
    "kubernetes.io/metadata.name": "monitoring"}}}]], ids=["default-metricsFrom", "prometheus-only"])
def test_network_policy_lets_the_operator_observe_the_cluster(case, metrics_from):
    values = dict(METRICS_CASES[case])
    if metrics_from is not None:
        values["networkPolicy"] = {"metricsFrom": metrics_from}
    docs = render(values)
    policies = by_kind(docs)["NetworkPolicy"]
    operator_pod, service = operator_parts(docs)
    operator = operator_pod["metadata"]["labels"]
    objects = cluster_objects(docs)
    [cluster] = [d for d in docs if d["kind"] == "SplitServeCluster"]
    resource = resource_of({**cluster, "metadata": {**cluster["metadata"], "uid": "u"}})
    observer = service_observer(NS, resource.metadata.name, resource.spec)  # the URLs the operator reads
    urls = [*observer.gateways] + ([observer.redis_url] if resource.spec.redis.mode == "bundled" else [])
    assert len(urls) == (2 if resource.spec.redis.mode == "bundled" else 1)
    for url in urls:
        pod, port = pods_behind(objects, url)
        assert admitted(policies, pod["metadata"]["labels"], port, NS, operator), url
    workers = [o["spec"]["template"] for o in objects if o["kind"] == "Deployment"
               and o["metadata"]["labels"].get(names.ROLE_LABEL) in ("prefill", "decode", "both")]
    assert workers
    for pod in workers:  # the registered workers' metrics_url, and their gRPC port for a role flip's Flip call
        labels = pod["metadata"]["labels"]
        assert admitted(policies, labels, container_port(pod, "metrics"), NS, operator)
        assert admitted(policies, labels, container_port(pod, "grpc"), NS, operator)
        assert not admitted(policies, labels, container_port(pod, "grpc"), "monitoring", {"app": "prometheus"})
        assert admitted(policies, labels, container_port(pod, "metrics"), "monitoring", {"app": "prometheus"})
    # Nothing the chart's policies select is the operator: Prometheus (any namespace) reaches its metrics port.
    metrics_port = container_port(operator_pod, service["spec"]["ports"][0]["targetPort"])
    assert admitted(policies, operator, metrics_port, "monitoring", {"app": "prometheus"})
    # Redis still refuses pods that are neither the cluster's nor the operator.
    if resource.spec.redis.mode == "bundled":
        redis_pod, redis_port = pods_behind(objects, observer.redis_url)
        assert not admitted(policies, redis_pod["metadata"]["labels"], redis_port, NS, {"app": "other"})


def test_notes_in_external_mode_point_keda_at_the_operators_metrics():
    values = VALUES["autoscaling-external-values"]
    with helm.Chart.load(str(CHART)) as c:
        notes = c.render(values, name="splitserve", namespace=NS)["splitserve/templates/NOTES.txt"]
        manual = c.render({}, name="splitserve", namespace=NS)["splitserve/templates/NOTES.txt"]
    _, service = operator_parts(render(values))
    url = f"http://{service['metadata']['name']}.{NS}.svc:{service['spec']['ports'][0]['port']}/metrics"
    assert url in notes and 'splitserve_autoscaler_desired_replicas{cluster="splitserve"' in notes
    assert "deploy/examples/keda/llama-8b-scaledobjects.yaml" in notes and "desired_replicas" not in manual
