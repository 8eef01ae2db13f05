"""The engine is chosen in one place (`splitserve.common.engines`): every kind resolves its parts, an unknown one is a
one-line error naming the field, and no module outside the registry compares an engine's name to a literal."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import get_args

import pytest

from splitserve.common import engines
from splitserve.common.config import ClusterResource, ClusterSpec, EngineSpec
from splitserve.common.engines import ENGINES, EngineKind

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("splitserve", "engine", "router", "prefill_worker", "decode_worker", "kv_transfer", "vllm_engine",
            "autoscaler")
REGISTRY = ROOT / "splitserve" / "common" / "engines.py"


def _names(node: ast.AST) -> list[str]:
    """The engine names `node` spells as literals: a string, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in ENGINES else []
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [n for elt in node.elts for n in _names(elt)]
    return []


def _comparisons(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            names = [n for side in (node.left, *node.comparators) for n in _names(side)]
        elif isinstance(node, ast.MatchValue):
            names = _names(node.value)
        else:
            continue
        if names:
            found.append(f"{path.relative_to(root)}:{node.lineno}: compares to {names[0]!r}")
    return found


def test_no_module_outside_the_registry_compares_an_engine_name():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if p != REGISTRY]
    assert len(files) > 100  # the whole package was scanned
    found = [line for path in files for line in _comparisons(path)]
    assert not found, "ask splitserve.common.engines instead:\n" + "\n".join(found)


def test_the_scan_sees_a_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if spec.engine_of(role) == "vllm":\n    pass\nif kind in ("native",):\n    pass\n'
                     'match kind:\n    case "vllm":\n        pass\nif kind == "cuda":\n    pass\n')
    assert [line.split(": ", 1)[0] for line in _comparisons(probe, tmp_path)] == ["probe.py:1", "probe.py:3", "probe.py:6"]


def test_the_configuration_model_offers_exactly_the_registered_engines():
    assert set(get_args(EngineKind)) == set(ENGINES)
    assert ClusterSpec.model_fields["engine"].default in ENGINES


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_each_engine_resolves_its_load_and_handover_sides(kind):
    entry = engines.get(kind)
    assert entry.name == kind
    load = entry.resolve_load()
    assert inspect.iscoroutinefunction(load)
    inspect.signature(load).bind(ClusterSpec(), "decode", "127.0.0.1", None, None)  # what `worker.serve` passes
    sides = entry.resolve_handovers()
    for side in ("prefill_side", "decode_side", "colocated_side"):
        fn = getattr(sides, side)
        assert inspect.iscoroutinefunction(fn), f"{kind}: {sides.__name__}.{side}"
        assert list(inspect.signature(fn).parameters) == ["spec", "engine", "ctx"]
    env = entry.resolve_process_env()
    assert env is None or callable(env)
    pod_server = entry.resolve_pod_server()
    assert (pod_server is not None) == entry.server_beside
    if pod_server is not None:  # the server's container, and how the worker beside it attaches
        resource = ClusterResource.model_validate({"spec": {"engine": kind}})
        server = pod_server(resource, "decode", resource.spec.decode, {"requests": {"cpu": "1", "memory": "4Gi"},
                                                                           "limits": {"cpu": "2", "memory": "4Gi"}})
        assert server.container["name"] == kind and server.worker_args[0] == f"--{kind}-url"
    assert isinstance(entry.connector(ClusterSpec()), str)


def test_the_engines_differ_where_the_hosts_ask():
    native, vllm = engines.get("native"), engines.get("vllm")
    assert native.takes_threads and not vllm.takes_threads
    assert vllm.server_beside and not native.server_beside and engines.attaching() == ["vllm"]
    assert vllm.shards_handover and not native.shards_handover
    assert native.resolve_process_env() is None
    spec = ClusterSpec.model_validate({"engine": "vllm", "vllm": {"connector": "pull"}})
    assert (vllm.connector(spec), native.connector(spec)) == ("pull", "")


def test_vllm_process_env_binds_cpu_threads_unless_set(monkeypatch):
    env = engines.get("vllm").resolve_process_env()
    spec = ClusterSpec.model_validate({"engine": "vllm", "model": {"device": "cpu"}})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    got = env(spec, "decode", 0, 1)
    assert got is None or set(got) == {"VLLM_CPU_OMP_THREADS_BIND"}  # None only on a host with no core to bind
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert env(spec, "decode", 0, 1) is None
    assert env(ClusterSpec.model_validate({"engine": "vllm", "model": {"device": "cuda"}}), "decode", 0, 1) is None


def test_an_unknown_engine_is_one_line_naming_the_field():
    with pytest.raises(ValueError) as e:
        engines.get("tgi")
    assert str(e.value) == "engine: unknown engine 'tgi' (one of native, vllm)"
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="kind"):
        EngineSpec.model_validate({"kind": "tgi"})  # the model refuses it before any lookup


@pytest.mark.parametrize("kind,doc,field", [
    ("native", {"decode": {"engine": {"dataParallelSize": 2}}}, "decode.engine.dataParallelSize"),
    ("vllm", {"decode": {"engine": {"threads": 2}}}, "decode.engine.threads"),
])
def test_each_engine_checks_the_configuration_it_cannot_honour(kind, doc, field):
    with pytest.raises(ValueError, match=field):
        ClusterSpec.model_validate({"engine": kind, **doc})
    other = "vllm" if kind == "native" else "native"
    ClusterSpec.model_validate({"engine": other, **doc})  # the other engine honours it
