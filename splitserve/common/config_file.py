"""Reading, overriding, writing and describing the configuration model: YAML files, overrides by field path
(what CLI flags set), one-line errors that name the field, and the JSON Schema (with no `$ref`, as a CRD's
`openAPIV3Schema` and a chart's `values.schema.json` need it).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.alias_generators import to_camel

from splitserve.common.config import ENGINE_DEFAULT, ClusterResource, ClusterSpec


class ConfigError(ValueError):
    """An invalid file, key or value; the message is one line naming the field and why."""


def _dotted(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _where(loc: tuple, source: str, flags: dict[str, str] | None) -> str:
    dotted = _dotted(loc)
    for key, flag in (flags or {}).items():
        if dotted == key or dotted.startswith((key + ".", key + "[")):
            return flag
    return f"{source}: {dotted}" if source else dotted


def _one_line(error: ValidationError, source: str, flags: dict[str, str] | None = None) -> str:
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    msg = first["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "value_error" and (m := re.match(r"^([A-Za-z.]+): (.+)$", msg)):
        loc, msg = loc + tuple(m.group(1).split(".")), m.group(2)  # a cross-field check names its field
    return f"{_where(loc, source, flags)}: {msg}"


def parse_resource(doc: Any, source: str = "", flags: dict[str, str] | None = None,
                   explicit: set[str] | None = None) -> ClusterResource:
    """Validate a document (a dict as YAML gives it); `flags` maps field paths to the flag that set them;
    `explicit`: spec field paths (snake_case) a user asked for on purpose (flags), which some checks treat as a
    choice even where the value equals the default."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source or 'config'}: expected a mapping with apiVersion, kind, metadata and spec")
    try:
        return ClusterResource.model_validate(doc, context={"explicit": explicit or set()})
    except ValidationError as e:
        raise ConfigError(_one_line(e, source, flags)) from None


def read_document(path: str | Path) -> dict:
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping with apiVersion, kind, metadata and spec")
    return doc


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
         flags: dict[str, str] | None = None) -> ClusterResource:
    """The file at `path` (or the defaults), with `overrides` (spec field path -> value) applied on top.

    Errors in the file name the file and the key; errors in an override name `flags[path]` (the CLI flag).
    """
    doc: dict = read_document(path) if path else {"metadata": {"name": "splitserve"}}
    source = str(path) if path else ""
    parse_resource(doc, source)
    if overrides:
        doc = copy.deepcopy(doc)
        spec = doc.setdefault("spec", {})
        for dotted, value in overrides.items():
            set_path(spec, dotted, value)
        flag_paths = {f"spec.{camel_path(k)}": v for k, v in (flags or {}).items()}
        return parse_resource(doc, source, flag_paths, set(overrides))
    return parse_resource(doc, source)


def camel_path(dotted: str) -> str:
    return ".".join(to_camel(p) for p in dotted.split("."))


def set_path(tree: dict, dotted: str, value: Any) -> None:
    """Set `a.b.c` (snake_case or camelCase segments) in a nested dict, creating sections on the way."""
    parts = camel_path(dotted).split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = node[part] = {}
        node = nxt
    node[parts[-1]] = value


def dump(resource: ClusterResource) -> str:
    """The resource as YAML with every value spelled out (what workers and the operator's ConfigMap read)."""
    data = resource.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"status"})
    return yaml.safe_dump(data, sort_keys=False)


def spec_field(dotted: str):
    """The pydantic FieldInfo of a spec path like `router.port`, and the model class holding it."""
    model: type[BaseModel] = ClusterSpec
    parts = dotted.split(".")
    for part in parts[:-1]:
        model = model.model_fields[part].annotation  # sections are plain model-typed fields
    return model, model.model_fields[parts[-1]]


# -- JSON Schema ------------------------------------------------------------------------------------------
def json_schema(model: type[BaseModel] = ClusterResource) -> dict:
    """The model's JSON Schema with every `$ref` inlined (CRDs and Helm reject references); a field whose default
    is the engine's (`config.ENGINE_DEFAULT`) has none in it."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return inline({**target, **rest})
            if node.get(ENGINE_DEFAULT):
                node = {k: v for k, v in node.items() if k not in (ENGINE_DEFAULT, "default")}
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(schema)


def schema_json() -> str:
    return json.dumps(json_schema(), indent=2)
