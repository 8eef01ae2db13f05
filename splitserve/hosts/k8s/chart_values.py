"""The Helm chart's values as a typed model: `cluster.spec` is the configuration model's `ClusterSpec`, the rest
configures the operator and the chart's extras. Its JSON Schema is the chart's `values.schema.json`, so a
values file is checked by `helm install` against the same model `splitserve up` reads.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from pydantic import Field

from splitserve.common.config import ClusterSpec, LocalObjectReference, Port, Spec
from splitserve.common.config_file import json_schema
from splitserve.hosts.k8s.pods import RESTRICTED_CONTAINER, RESTRICTED_POD


class OperatorValues(Spec):
    image: str = "ghcr.io/splitserve/gateway:0.1.0"
    """The operator's image (the slim gateway image runs `splitserve operator`)."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When to pull the operator's image."""
    cluster_wide: bool = False
    """Watch SplitServeClusters in every namespace (a ClusterRole); false: only the release's namespace (a Role)."""
    resync_seconds: float = Field(30.0, gt=0)
    """How often each cluster is reconciled even without a change (readiness, scale subresource)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """The operator's log level."""
    metrics_port: Port = 9090
    """The operator's Prometheus metrics port (`--metrics-port`, a Service port named `metrics`): the autoscaler's
    desired replicas per role, which KEDA/HPA read in `autoscaling.mode: external`."""
    resources: dict[str, dict[str, int | str]] = Field(default_factory=dict)
    """The operator container's resource requests and limits (both, so a ResourceQuota admits it)."""
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    """Secrets the operator's pod pulls its image with, e.g. [{name: regcred}] (the cluster's pods:
    cluster.spec.kubernetes.imagePullSecrets)."""
    pod_security_context: dict[str, Any] = Field(default_factory=lambda: dict(RESTRICTED_POD))
    """The operator pod's securityContext (the restricted Pod Security Standard)."""
    security_context: dict[str, Any] = Field(default_factory=lambda: copy.deepcopy(RESTRICTED_CONTAINER))
    """The operator container's securityContext (the restricted Pod Security Standard, read-only root)."""
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations on the operator's pod."""
    pod_labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on the operator's pod."""
    priority_class_name: str = ""
    """The operator pod's PriorityClass (empty: none)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the operator's pod must run on."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Tolerations of the operator's pod."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Affinity of the operator's pod."""


class ClusterValues(Spec):
    create: bool = True
    """Create a SplitServeCluster from `spec` (false: install only the operator and CRDs)."""
    name: str = Field("", pattern=r"^([a-z]([-a-z0-9]*[a-z0-9])?)?$", max_length=55)
    """The SplitServeCluster's name (default: the release name)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels on the SplitServeCluster (copied to everything the operator creates)."""
    spec: ClusterSpec = Field(default_factory=ClusterSpec)
    """The SplitServeCluster's spec: the configuration model (the same keys as a `splitserve up -f` file)."""


class ApiKeysValues(Spec):
    create: bool = False
    """Create a Secret holding `keys` and point cluster.spec.router.apiKeySecret at it."""
    keys: list[str] = Field(default_factory=list)
    """Gateway API keys; clients send one as a Bearer token."""


class NetworkPolicyValues(Spec):
    enabled: bool = True
    """Clients reach only the gateway; workers accept gRPC only from the gateway and other workers; Redis only
    from the cluster's pods and the operator (whose autoscaler also scrapes the workers' metrics)."""
    metrics_from: list[dict[str, Any]] = Field(default_factory=lambda: [{"namespaceSelector": {}}])
    """NetworkPolicy peers allowed to scrape the workers' metrics port (default: any pod in the cluster)."""


class ServiceMonitorValues(Spec):
    enabled: bool = True
    """Create a ServiceMonitor (only where the monitoring.coreos.com/v1 API exists)."""
    interval: str = "30s"
    """Scrape interval."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels (e.g. the `release` label your Prometheus selects on)."""


class PrometheusRuleValues(Spec):
    enabled: bool = True
    """Create the SLO alert rules as a PrometheusRule (only where the monitoring.coreos.com/v1 API exists)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels (e.g. the `release` label your Prometheus selects on)."""


class DashboardValues(Spec):
    enabled: bool = True
    """Create a ConfigMap holding the Grafana dashboard."""
    labels: dict[str, str] = Field(default_factory=lambda: {"grafana_dashboard": "1"})
    """Labels Grafana's dashboard sidecar selects on."""


class MonitoringValues(Spec):
    service_monitor: ServiceMonitorValues = Field(default_factory=ServiceMonitorValues)
    """Prometheus Operator scraping of the gateway, the workers and the operator."""
    prometheus_rule: PrometheusRuleValues = Field(default_factory=PrometheusRuleValues)
    """SLO alerts."""
    grafana_dashboard: DashboardValues = Field(default_factory=DashboardValues)
    """The Grafana dashboard."""


class ChartValues(Spec):
    """Values of the splitserve Helm chart."""

    operator: OperatorValues = Field(default_factory=OperatorValues)
    """The operator's Deployment and its RBAC."""
    cluster: ClusterValues = Field(default_factory=ClusterValues)
    """The default SplitServeCluster."""
    api_keys: ApiKeysValues = Field(default_factory=ApiKeysValues)
    """An optional Secret of gateway API keys."""
    network_policy: NetworkPolicyValues = Field(default_factory=NetworkPolicyValues)
    """NetworkPolicies for the cluster's pods."""
    monitoring: MonitoringValues = Field(default_factory=MonitoringValues)
    """ServiceMonitor, alert rules and the Grafana dashboard."""


def values_schema() -> dict[str, Any]:
    """The chart's values.schema.json (`$ref`s inlined, as Helm needs)."""
    schema = json_schema(ChartValues)
    return {"$schema": "http://json-schema.org/draft-07/schema#", **schema}  # Helm 3 and 4 both read draft 7


def values_schema_json() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"
