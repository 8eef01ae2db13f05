"""The Kubernetes commands as a user runs them: `splitserve render -f FILE` prints, as a YAML stream, every object
the operator's first pass creates for that SplitServeCluster (the operator's own builders; each object valid
Kubernetes 1.33), and a bad file is one line naming the field with exit code 2 (the installed command and
`splitserve operator` without credentials: tests/e2e/test_k8s_cli_installed.py)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from splitserve.cli import app
from splitserve.hosts.k8s.children import children, owner_reference
from splitserve.hosts.k8s.crd import role_crd
from splitserve.hosts.k8s.reconcile import resource_of
from splitserve.hosts.k8s.replicas import Observed, decide, spec_or_scale
from unit.deploy.test_chart import CASES
from unit.deploy.test_chart import render as helm_render
from unit.deploy.test_k8s_schema import admit

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def render(path: Path, *args: str) -> list[dict]:
    """`splitserve render -f PATH ARGS...`, its output parsed as a YAML stream."""
    result = CliRunner().invoke(app, ["render", "-f", str(path), *args])
    assert result.exit_code == 0, result.output
    return list(yaml.safe_load_all(result.output))


def validate(obj: dict) -> None:
    if obj["kind"] == "SplitServeRole":
        assert admit(role_crd(), obj)[1] == []
    else:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def chart_cluster(case: str, tmp_path: Path) -> Path:
    """The SplitServeCluster the chart installs with `case`'s values, as a file."""
    [cluster] = [d for d in helm_render(CASES[case]) if d["kind"] == "SplitServeCluster"]
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return path


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_render_prints_the_operators_objects(path):
    objects = render(path)
    for obj in objects:
        validate(obj)
    # exactly what a reconcile pass applies for the spec's replicas (less the owner, whose uid is unknown)
    doc = yaml.safe_load(path.read_text())
    resource = resource_of(doc)
    expected = children(resource, decide(resource.spec, spec_or_scale(resource.spec, Observed())),
                        owner_reference({**doc, "metadata": {**doc["metadata"], "uid": "u"}}))
    for obj in expected:
        del obj["metadata"]["ownerReferences"]
    assert objects == expected
    kinds = {o["kind"] for o in objects}
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "SplitServeRole"} <= kinds


@pytest.mark.parametrize("case", CASES)
def test_render_of_every_chart_install_is_valid_kubernetes(case, tmp_path):
    objects = render(chart_cluster(case, tmp_path))
    for obj in objects:
        validate(obj)
        assert obj["metadata"]["namespace"] == "serving"
    assert ("StatefulSet" in {o["kind"] for o in objects}) == (case != "external-redis-values")


def test_render_with_a_uid_owns_its_objects_and_takes_a_namespace(tmp_path):
    doc = yaml.safe_load((ROOT / "deploy/examples/local-cpu.yaml").read_text())
    doc["metadata"]["uid"] = "0b5c1d2e-0000-4000-8000-000000000001"
    path = tmp_path / "live.yaml"
    path.write_text(yaml.safe_dump(doc))
    for obj in render(path, "--namespace", "team-a"):
        assert obj["metadata"]["namespace"] == "team-a"
        [owner] = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("SplitServeCluster", "local-cpu", doc["metadata"]["uid"])


@pytest.mark.parametrize("text,message", [
    ("metadata: {name: llm}\nspec: {decode: {replicas: -1}}\n", "spec.decode.replicas: must be greater than"),
    ("metadata: {name: llm}\nspec: {router: {prot: 8000}}\n", "spec.router.prot: unknown key"),
    ("metadata: {name: llm}\nspec: {redis: {mode: external}}\n", "redis.mode is external but neither"),
    ("metadata: {name: 1llm}\nspec: {}\n", "metadata.name"),
    ("kind: Deployment\nmetadata: {name: llm}\n", "kind: must be 'SplitServeCluster'"),
    ("spec: [\n", "not valid YAML"),
])
def test_bad_input_is_one_line_naming_the_field(text, message, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["render", "-f", str(path)])
    assert result.exit_code == 2
    [line] = result.output.splitlines()
    assert line.startswith("splitserve: error: ") and message in line, line
