"""JSON Schema (as pydantic writes it, `$ref`s inlined) → a Kubernetes *structural* OpenAPI v3 schema, the form
a CRD's `openAPIV3Schema` must take: every node typed, `Optional` as `nullable: true`, free-form maps as
`x-kubernetes-preserve-unknown-fields`, int-or-string as `x-kubernetes-int-or-string`, no
`additionalProperties: false` beside `properties` (the API server prunes unknown fields instead), draft-2020
numeric exclusives as OpenAPI 3.0 booleans, and `default: {}` on sections so the API server fills in every
nested default. Descriptions, defaults, bounds, enums and patterns are kept.
"""

from __future__ import annotations

from typing import Any

# Keys with the same meaning in both dialects, copied as they are.
_KEEP = ("description", "default", "minimum", "maximum", "minLength", "maxLength", "pattern", "enum",
         "minItems", "maxItems", "format", "required")


def structural(node: dict[str, Any], section_defaults: bool = True) -> dict[str, Any]:
    """The structural schema of one JSON Schema node (recursively); `section_defaults` adds `default: {}` to
    nested objects that have no default of their own (a spec's sections; not a status's)."""
    node = dict(node)
    options = node.pop("anyOf", None)
    nullable = False
    if options is not None:
        kinds = [o for o in options if o.get("type") != "null"]
        nullable = len(kinds) < len(options)
        if {o.get("type") for o in kinds} == {"integer", "string"}:
            return _with_meta({"x-kubernetes-int-or-string": True}, node, nullable)
        if len(kinds) != 1:
            raise ValueError(f"no structural form for anyOf {options!r}")
        node = {**kinds[0], **node}  # the outer node's description/default win
    out = _convert(node, section_defaults)
    return _with_meta(out, node, nullable)


def _with_meta(out: dict[str, Any], node: dict[str, Any], nullable: bool) -> dict[str, Any]:
    for key in _KEEP:
        if key in node and key not in out:
            out[key] = node[key]
    if out.get("default", ...) is None:
        del out["default"]  # null defaults: absent means the same
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if nullable:
        out["nullable"] = True
    return out


def _convert(node: dict[str, Any], section_defaults: bool) -> dict[str, Any]:
    kind = node.get("type")
    if kind == "object":
        props = node.get("properties")
        extra = node.get("additionalProperties")
        if props is not None:
            out: dict[str, Any] = {"type": "object",
                                   "properties": {k: structural(v, section_defaults) for k, v in props.items()}}
            if section_defaults and "default" not in node:
                out["default"] = {}  # so nested defaults apply when the section is left out
            return out
        if isinstance(extra, dict) and extra:
            return {"type": "object", "additionalProperties": structural(extra, section_defaults)}
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}  # dict[str, Any]
    if kind == "array":
        items = structural(node.get("items", {"type": "object"}), section_defaults)
        if items.get("default") == {}:
            del items["default"]  # an item is never absent; and `{}` need not be a valid item (required keys)
        return {"type": "array", "items": items}
    if kind in ("string", "integer", "number", "boolean"):
        return {"type": kind}
    raise ValueError(f"no structural form for {node!r}")
