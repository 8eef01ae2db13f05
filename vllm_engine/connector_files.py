"""splitserve's vLLM connectors' files, for a vLLM image without splitserve installed (the stock `vllm/vllm-openai`).

vLLM imports `splitserve.vllm_engine.in_vllm.pool_connector` (the KV pool's) and `...layerwise_connector` by module
path inside its own processes. On Kubernetes a worker pod's init container (the worker image) runs `splitserve
vllm-connector DIR` into an emptyDir that the vLLM container mounts read-only and puts on its PYTHONPATH. What is
copied is the connectors' import closure within splitserve and redis-py (pure Python both); numpy, torch, pyzmq,
NIXL and vLLM are the image's own.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

# splitserve's modules the connectors import (tests/e2e/test_vllm_pool_plan_cli.py imports them from a copy alone)
_IN_VLLM = ("pool_plan", "pool_connector", "layerwise_wire", "control_link", "layerwise_plan", "layerwise_peers",
            "layerwise_mover", "layerwise_connector", "ucx_transport")
CONNECTOR_MODULES = ("splitserve", "splitserve.common", "splitserve.common.hashing", "splitserve.common.redis_wire",
                     "splitserve.vllm_engine", "splitserve.vllm_engine.in_vllm",
                     *(f"splitserve.vllm_engine.in_vllm.{m}" for m in _IN_VLLM))
PACKAGES = ("redis",)  # copied whole


def _origin(name: str) -> tuple[Path, bool]:
    """(the module's source file, whether it is a package's __init__)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{name} is not installed here")
    return Path(spec.origin), spec.submodule_search_locations is not None


def copy_connector(dest: Path) -> list[Path]:
    """Copy the connector's files under `dest` (created if missing); returns the files written."""
    written = []
    for name in CONNECTOR_MODULES:
        source, package = _origin(name)
        parts = name.split(".")
        target = dest.joinpath(*parts, "__init__.py") if package else dest.joinpath(*parts[:-1], parts[-1] + ".py")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        written.append(target)
    for name in PACKAGES:
        source, _ = _origin(name)
        target = dest / name
        shutil.copytree(source.parent, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        written += sorted(p for p in target.rglob("*.py"))
    return written
