"""The Kubernetes commands: `splitserve operator` runs the kopf operator that reconciles SplitServeClusters;
`splitserve crd` prints the CustomResourceDefinitions generated from the configuration model (or, with
`--values-schema`, the Helm chart's values.schema.json). kopf and the kubernetes client load only when the
operator runs, so `crd` works anywhere splitserve is installed.
"""

from __future__ import annotations

import click

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
        from splitserve.autoscaler.operator.run import run
    except ImportError as e:
        raise click.ClickException(f"the operator needs kopf and kubernetes: pip install 'splitserve[k8s]' ({e})") from None
    run(namespaces, all_namespaces, resync_seconds, health_port, metrics_port)


@click.command("crd")
@click.option("--values-schema", is_flag=True, help="print the Helm chart's values.schema.json instead")
def crd(values_schema: bool) -> None:
    """Print the SplitServeCluster and SplitServeRole CRDs (YAML), generated from the configuration model."""
    if values_schema:
        from splitserve.autoscaler.operator.chart_values import values_schema_json

        click.echo(values_schema_json(), nl=False)
    else:
        from splitserve.autoscaler.operator.crd import crd_yaml

        click.echo(crd_yaml(), nl=False)
