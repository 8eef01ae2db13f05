"""The Kubernetes commands: `splitserve operator` runs the kopf operator that reconciles SplitServeClusters;
`splitserve crd` prints the CustomResourceDefinitions generated from the configuration model (or, with
`--values-schema`, the Helm chart's values.schema.json); `splitserve render -f FILE` prints every object the
operator would create for a SplitServeCluster, with the operator's own builders. kopf and the kubernetes client
load only when the operator runs, so `crd` and `render` work anywhere splitserve is installed.
"""

from __future__ import annotations

import re

import click
import yaml

from splitserve.common.logs import setup_logging


@click.command("operator")
@click.option("-n", "--namespace", "namespaces", multiple=True, help="a namespace to watch (repeatable)")
@click.option("-A", "--all-namespaces", "all_namespaces", is_flag=True, help="watch every namespace")
@click.option("--resync-seconds", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="reconcile each cluster this often even without a change (readiness, drift)")
@click.option("--health-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="answer liveness probes on http://0.0.0.0:PORT/healthz (0: off)")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="serve Prometheus metrics (the autoscaler's desired replicas per role, for KEDA/HPA in "
                   "external mode) on http://0.0.0.0:PORT/metrics (0: off)")
def operator(namespaces: tuple[str, ...], all_namespaces: bool, resync_seconds: float, health_port: int,
             metrics_port: int) -> None:
    """Run the Kubernetes operator (kopf): SplitServeClusters into Deployments, Services, PDBs and Redis."""
    if bool(namespaces) == all_namespaces:
        raise click.UsageError("give --namespace NS (repeatable) or --all-namespaces")
    setup_logging()
    try:
        from kubernetes.config import ConfigException

        from splitserve.hosts.k8s.run import run
    except ImportError as e:
        raise click.ClickException(f"the operator needs kopf and kubernetes: pip install 'splitserve[k8s]' ({e})") from None
    try:
        run(namespaces, all_namespaces, resync_seconds, health_port, metrics_port)
    except ConfigException as e:  # neither a pod's service account nor a usable kubeconfig
        reason = re.sub(r"\s+", " ", str(e)).strip()
        raise click.ClickException(f"no Kubernetes credentials: not in a pod, and no usable kubeconfig ({reason}); "
                                   "set KUBECONFIG or run it in the cluster") from None


@click.command("crd")
@click.option("--values-schema", is_flag=True, help="print the Helm chart's values.schema.json instead")
def crd(values_schema: bool) -> None:
    """Print the SplitServeCluster and SplitServeRole CRDs (YAML), generated from the configuration model."""
    if values_schema:
        from splitserve.hosts.k8s.chart_values import values_schema_json

        click.echo(values_schema_json(), nl=False)
    else:
        from splitserve.hosts.k8s.crd import crd_yaml

        click.echo(crd_yaml(), nl=False)


@click.command("render")
@click.option("-f", "--file", "path", required=True, type=click.Path(dir_okay=False),
              help="a SplitServeCluster document (what `kubectl apply -f` and `splitserve up -f` take)")
@click.option("-n", "--namespace", default=None,
              help="the namespace the objects go to (default: the file's metadata.namespace, else default)")
def render(path: str, namespace: str | None) -> None:
    """Print every Kubernetes object the operator would create for a SplitServeCluster, as a YAML stream."""
    from splitserve.common.config_file import ConfigError, parse_resource, read_document
    from splitserve.hosts.k8s.children import preview
    from splitserve.hosts.k8s.replicas import Unrealisable

    try:
        doc = read_document(path)
        resource = parse_resource(doc, path)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if namespace:
        resource.metadata.namespace = namespace
    try:
        objects = preview(resource, uid=(doc.get("metadata") or {}).get("uid"))
    except Unrealisable as e:
        raise click.ClickException(f"{path}: {e.message}") from None
    click.echo(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=120), nl=False)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's cluster.yaml) as literal blocks, readable as the file they are."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _str)
