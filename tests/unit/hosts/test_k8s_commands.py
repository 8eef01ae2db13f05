"""Every command line the operator puts in a pod, and the one the chart gives the operator, parsed by the local
`splitserve` CLI (the real click commands), and every rendered config read by the real config loader: neither the
operator nor the chart can name a flag or a config key the program does not have."""

from __future__ import annotations

from pathlib import Path

import click
import helm_python as helm
import pytest
import yaml

from splitserve.cli import app
from splitserve.common.config_file import load
from splitserve.hosts.k8s.children import children, owner_reference
from splitserve.hosts.k8s.names import CONFIG_FILE, CONFIG_PATH
from splitserve.hosts.k8s.reconcile import resource_of
from splitserve.hosts.k8s.replicas import Observed, decide, spec_or_scale

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def parse(argv: list[str], env: dict[str, str]) -> click.Context:
    """`argv` as the kubelet expands it ($(VAR) from the container's env), parsed by splitserve's click app
    (options and their types checked; the command does not run)."""
    assert argv[0] == "splitserve"
    args = [env.get(a[2:-1], a) if a.startswith("$(") else a for a in argv[1:]]
    with click.Context(app, info_name="splitserve") as parent:
        command = app.get_command(parent, args[0])
        assert command is not None, f"no command {args[0]!r}"
        return command.make_context(args[0], args[1:], parent=parent)


def rendered(path: Path) -> list[dict]:
    doc = yaml.safe_load(path.read_text())
    doc["metadata"].update(namespace="serving", uid="uid-1")
    resource = resource_of(doc)
    decision = decide(resource.spec, spec_or_scale(resource.spec, Observed()))
    return children(resource, decision, owner_reference(doc))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_operator_pod_commands_parse_and_configs_load(path, tmp_path):
    objects = rendered(path)
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap"]
    config = tmp_path / CONFIG_FILE
    config.write_text(config_map["data"][CONFIG_FILE])
    resource = load(config)  # what every pod's --config reads
    assert resource.metadata.name == yaml.safe_load(path.read_text())["metadata"]["name"]
    commands = 0
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            argv = container.get("command")
            if not argv:
                continue  # Redis: the image's own entrypoint
            if container["name"] == "vllm":  # engine vllm: the stock server beside the worker, serving its model
                assert argv[:4] == ["python3", "-P", "-m", "vllm.entrypoints.openai.api_server"], argv
                assert argv[argv.index("--model") + 1] == resource.spec.model.name
                continue
            env = {e["name"]: f"<{e['name']}>" for e in container.get("env", [])}
            ctx = parse([a.replace(CONFIG_PATH, str(config)) for a in argv], env)
            commands += 1
            if ctx.info_name == "worker":
                assert ctx.params["role"] in ("prefill", "decode", "both")
                assert ctx.params["worker_name"] == "<POD_NAME>" and ctx.params["advertise_host"] == "<POD_IP>"
                assert ctx.params["host"] == "0.0.0.0"
    assert commands >= 2  # a worker role and the gateway (+ fetch-model for the embedded model)


def test_the_charts_operator_command_parses():
    with helm.Chart.load(str(ROOT / "charts/splitserve")) as c:
        for values in ({}, {"operator": {"clusterWide": True}}):
            docs = yaml.safe_load_all(c.render(values, name="splitserve", namespace="serving")
                                      ["splitserve/templates/operator.yaml"])
            [deployment] = [d for d in docs if d and d["kind"] == "Deployment"]
            ctx = parse(deployment["spec"]["template"]["spec"]["containers"][0]["command"], {})
            assert ctx.info_name == "operator" and ctx.params["health_port"] == 8080


def test_dockerfile_default_commands_parse():
    text = (ROOT / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("CMD "):
            parse(["splitserve", *yaml.safe_load(line[4:])], {})
