"""The CRDs are generated from the configuration model and are what the chart ships; they are structural (what
the API server requires) and valid CustomResourceDefinitions for Kubernetes 1.33; the example resources pass
their schema and CEL rules, and bad ones are refused with messages a person understands."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from splitserve.cli import app
from splitserve.common.config import ClusterResource
from splitserve.common.config_file import ConfigError, parse_resource
from splitserve.hosts.k8s.crd import crd_yaml, crds
from splitserve.hosts.k8s.status import ClusterStatus
from unit.deploy.test_k8s_schema import admit, to_json_schema

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
CLUSTER_CRD, ROLE_CRD = crds()


def test_splitserve_crd_prints_what_the_chart_ships():
    result = CliRunner().invoke(app, ["crd"])
    assert result.exit_code == 0, result.output
    assert result.output == crd_yaml() == (ROOT / "charts/splitserve/crds/splitserve-crds.yaml").read_text()
    docs = list(yaml.safe_load_all(result.output))
    assert [d["spec"]["names"]["kind"] for d in docs] == ["SplitServeCluster", "SplitServeRole"]


@pytest.mark.parametrize("crd", [CLUSTER_CRD, ROLE_CRD], ids=["cluster", "role"])
def test_crds_are_valid_for_kubernetes_1_33(crd):
    kubernetes_validate.validate(crd, "1.33", strict=True)


def _walk(node, path="schema"):
    yield path, node
    for key in ("properties", "additionalProperties"):
        sub = node.get(key)
        if isinstance(sub, dict) and key == "properties":
            for name, child in sub.items():
                yield from _walk(child, f"{path}.{name}")
        elif isinstance(sub, dict):
            yield from _walk(sub, f"{path}[*]")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


@pytest.mark.parametrize("crd", [CLUSTER_CRD, ROLE_CRD], ids=["cluster", "role"])
def test_schemas_are_structural(crd):
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("default", ...) is not None, f"{path}: null default"


def test_cluster_spec_schema_keeps_the_models_meaning():
    spec = CLUSTER_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["prefill"]["properties"]["replicas"] == {
        "type": "integer", "description": "Workers of this role (the autoscaler moves this within minReplicas..maxReplicas).",
        "default": 1, "minimum": 0}
    assert spec["ratio"]["properties"]["min"]["nullable"] is True
    assert spec["model"]["properties"]["device"]["pattern"] == "^(auto|cpu|cuda(:\\d+)?)$"
    assert spec["autoscaling"]["properties"]["mode"]["enum"] == ["manual", "slo", "external"]
    assert spec["decode"]["properties"]["affinity"] == {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True,
        "description": "Kubernetes: affinity of this role's pods."}
    assert spec["decode"]["properties"]["tolerations"]["items"]["x-kubernetes-preserve-unknown-fields"] is True
    quantity = spec["decode"]["properties"]["resources"]["additionalProperties"]["additionalProperties"]
    assert quantity["x-kubernetes-int-or-string"] is True
    assert spec["slo"]["properties"]["ttftSeconds"]["exclusiveMinimum"] is True
    assert spec["redis"]["default"] == {} and "default" not in spec["redis"]["properties"]["url"]


def test_printer_columns_and_subresources():
    version = CLUSTER_CRD["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == \
        ["Model", "Prefill", "Decode", "Ratio", "Ready", "Age"]
    assert version["subresources"] == {"status": {}}
    assert CLUSTER_CRD["spec"]["names"]["shortNames"] == ["ssc"] and CLUSTER_CRD["spec"]["scope"] == "Namespaced"
    role = ROLE_CRD["spec"]["versions"][0]
    assert role["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                             "statusReplicasPath": ".status.replicas",
                                             "labelSelectorPath": ".status.selector"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_admitted_and_read_by_the_model(path):
    doc = yaml.safe_load(path.read_text())
    stored, errors = admit(CLUSTER_CRD, doc)
    assert errors == []
    # What the API server stores (every default filled in) is still a document the model reads as the same spec.
    assert parse_resource(stored).spec == parse_resource(doc).spec


def _local_cpu() -> dict:
    return yaml.safe_load((ROOT / "deploy/examples/local-cpu.yaml").read_text())


def _with(**changes) -> dict:
    doc = _local_cpu()
    for dotted, value in changes.items():
        node = doc
        *parts, last = dotted.split("__")
        for part in parts:
            node = node.setdefault(part, {})
        node[last] = value
    return doc


BAD = [
    ("replicas above max", _with(spec__decode__maxReplicas=2, spec__decode__replicas=3),
     ".spec.decode.replicas: replicas (3) must be within minReplicas..maxReplicas (0..2)"),
    ("min above max", _with(spec__prefill__minReplicas=5, spec__prefill__maxReplicas=2, spec__prefill__replicas=2),
     ".spec.prefill.minReplicas: minReplicas (5) must not be above maxReplicas (2)"),
    ("ratio bounds crossed", _with(spec__ratio={"min": 1.0, "max": 0.5}),
     ".spec.ratio: ratio.min must not be above ratio.max (both are prefill replicas / decode replicas)"),
    ("no prefill in disaggregated mode", _with(spec__prefill__replicas=0),
     ".spec.prefill.replicas: prefill.replicas: disaggregated mode needs at least one prefill worker"),
    ("no decode", _with(spec__decode__replicas=0),
     ".spec.decode.replicas: decode.replicas: at least one decode (or colocated) worker is needed"),
    ("name Services cannot carry", _with(metadata={"name": "9-" + "x" * 60}),
     "metadata.name must be a DNS label that starts with a letter, at most 55 characters"),
    ("unknown mode", _with(spec__autoscaling={"mode": "magic"}), "spec.autoscaling.mode: 'magic' is not one of"),
    ("negative replicas", _with(spec__decode__replicas=-1), "spec.decode.replicas: -1 is less than the minimum of 0"),
    ("unknown key", _with(spec__router__prot=8000), "spec.router: Additional properties are not allowed ('prot'"),
    ("bad device", _with(spec__model__device="tpu"), "spec.model.device: 'tpu' does not match"),
]


@pytest.mark.parametrize("doc,expected", [(d, e) for _, d, e in BAD], ids=[n for n, _, _ in BAD])
def test_bad_resources_are_refused_with_a_clear_message(doc, expected):
    _, errors = admit(CLUSTER_CRD, doc)
    assert len(errors) >= 1 and any(e.startswith(expected) for e in errors), errors
    if not expected.startswith("metadata"):  # Service names are the CRD's and the operator's concern
        with pytest.raises(ConfigError):  # the model agrees: `splitserve up -f` refuses the same file
            parse_resource(copy.deepcopy(doc))


def test_status_the_operator_writes_fits_the_status_schema():
    status = ClusterStatus.model_validate({
        "observedGeneration": 3, "model": "smollm2", "prefill": "1/1", "decode": "2/3", "ratio": 0.3333,
        "readyReplicas": {"prefill": 1, "decode": 2, "gateway": 1},
        "desiredReplicas": {"prefill": 1, "decode": 3, "gateway": 1},
        "lastDecision": {"prefill": 1, "decode": 3, "reason": "manual: spec replicas", "time": "2026-01-01T00:00:00Z"},
        "conditions": [{"type": "Ready", "status": "False", "reason": "ReplicasNotReady", "message": "waiting",
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 3}]})
    doc = _local_cpu() | {"status": status.model_dump(by_alias=True, exclude_none=True)}
    schema = CLUSTER_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(doc["status"], to_json_schema(schema["properties"]["status"]))
    assert ClusterResource.model_validate(doc).status["prefill"] == "1/1"  # status is ignored on input


def test_splitserve_crd_values_schema_is_the_charts():
    result = CliRunner().invoke(app, ["crd", "--values-schema"])
    assert result.exit_code == 0
    assert result.output == (ROOT / "charts/splitserve/values.schema.json").read_text()
