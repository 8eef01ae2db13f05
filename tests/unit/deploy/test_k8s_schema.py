"""What the API server does with a custom resource, done here with real libraries (no API server can run): apply
the structural schema's defaults, validate with `jsonschema` (OpenAPI 3.0's `nullable`, boolean exclusive bounds
and int-or-string turned into their JSON Schema equivalents), and evaluate every `x-kubernetes-validations` CEL
rule with cel-python, returning the messages a user would see. `admit` is used by the CRD, chart and docs tests;
the tests here check it behaves as the API server does on small schemas.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema


def to_json_schema(node: Any) -> Any:
    """A structural OpenAPI v3 schema as JSON Schema (draft 2020-12), recursively."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if node.get("exclusiveMaximum") is True:
        out["exclusiveMaximum"] = out.pop("maximum")
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # the API server prunes (or, with strict field validation, refuses)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's defaulting: absent properties with a `default` get it, recursively."""
    if not isinstance(value, dict) or "properties" not in schema:
        if isinstance(value, list) and "items" in schema:
            return [apply_defaults(schema["items"], v) for v in value]
        return value
    out = dict(value)
    for key, sub in schema["properties"].items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


def _typed(schema: dict[str, Any], value: Any) -> Any:
    """Numbers as the schema types them (CEL tells int from double)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return {k: _typed(props.get(k, extra), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(schema.get("items", {}), v) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """`path: message` for every CEL rule that fails on `value` (already defaulted)."""
    errors = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        activation = {"self": celpy.json_to_cel(_typed(schema, value))}
        if not env.program(env.compile(rule["rule"])).evaluate(activation):
            message = rule["message"]
            if "messageExpression" in rule:
                message = str(env.program(env.compile(rule["messageExpression"])).evaluate(activation))
            errors.append(f"{path + rule.get('fieldPath', '')}: {message}".lstrip(": "))
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], f"{path}.{key}")
    return errors


def admit(crd: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What the API server stores and the errors it answers with (empty: accepted)."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    body = {k: v for k, v in obj.items() if k != "status"}
    body["spec"] = apply_defaults(schema["properties"]["spec"], body.get("spec", {}))
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(body)]
    if not errors:
        errors = cel_errors(schema, body)
    return body, errors


SMALL = {"type": "object", "properties": {
    "spec": {"type": "object", "default": {}, "properties": {
        "replicas": {"type": "integer", "default": 1, "minimum": 0},
        "ratio": {"type": "number", "nullable": True, "minimum": 0, "exclusiveMinimum": True},
        "quantity": {"x-kubernetes-int-or-string": True},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        "x-kubernetes-validations": [{"rule": "self.replicas <= 3", "message": "too many",
                                      "messageExpression": "'replicas ' + string(self.replicas) + ' > 3'"}]}}}
SMALL_CRD = {"spec": {"versions": [{"schema": {"openAPIV3Schema": SMALL}}]}}


def test_defaults_are_applied_before_validation():
    stored, errors = admit(SMALL_CRD, {"spec": {}})
    assert errors == [] and stored["spec"] == {"replicas": 1}


def test_openapi_forms_map_to_json_schema():
    assert admit(SMALL_CRD, {"spec": {"ratio": None, "quantity": "1Gi", "free": {"a": {"b": 1}}}})[1] == []
    assert admit(SMALL_CRD, {"spec": {"quantity": 2}})[1] == []
    assert admit(SMALL_CRD, {"spec": {"ratio": 0}})[1] == ["spec.ratio: 0 is less than or equal to the minimum of 0"]
    assert admit(SMALL_CRD, {"spec": {"extra": 1}})[1][0].startswith("spec: Additional properties")


def test_cel_rules_report_their_message_expression():
    assert admit(SMALL_CRD, {"spec": {"replicas": 5}})[1] == [".spec: replicas 5 > 3"]
