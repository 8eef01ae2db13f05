"""The architecture holds: import-linter's contracts (docs/architecture.md's forbidden arrows) on the real code,
and a gateway process that serves requests without ever loading torch.

The installed package maps top-level folders (engine/, router/, ...) onto `splitserve.*`; import-linter reads
packages from one directory, so the tests lay the sources out as the package they install as.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("engine", "router", "prefill_worker", "decode_worker", "kv_transfer", "vllm_engine", "autoscaler")
LINT = Path(sys.executable).parent / "lint-imports"


def package_layout(dest: Path) -> Path:
    """Copy the Python sources into `dest/splitserve/...` as they are installed; returns dest."""
    pkg = dest / "splitserve"
    shutil.copytree(ROOT / "splitserve", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in COMPONENTS:
        shutil.copytree(ROOT / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def lint_imports(layout: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=layout,
                          env={"PYTHONPATH": str(layout), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=300)


def test_import_contracts_hold(tmp_path):
    res = lint_imports(package_layout(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout and "12 kept" in res.stdout


@pytest.mark.parametrize("module,imports,contract", [
    ("router/_probe.py", "import splitserve.engine.llm_engine", "Gateway: no engine"),
    ("router/_probe.py", "import torch", "Gateway: no engine"),
    ("router/_probe.py", "import splitserve.decode_worker.service", "Roles are independent"),
    ("engine/_probe.py", "import splitserve.router.gateway", "Layers"),
    ("common/_probe.py", "import splitserve.cli", "Layers"),
    ("common/_probe.py", "import torch", "Bottom layer: no torch"),
    ("kv_transfer/_probe.py", "import splitserve.router.policy", "kv_transfer: no router"),
    ("autoscaler/_probe.py", "import splitserve.engine.scheduler", "Autoscaler: no engine"),
    ("decode_worker/service.py", "import splitserve.kv_transfer.agent", "Role services: the engine seams only"),
    ("prefill_worker/service.py", "import splitserve.engine.async_engine", "Role services: the engine seams only"),
    ("router/_probe.py", "import grpc", "Gateway: workers through WorkerClient only"),
    ("hosts/local/_probe.py", "import splitserve.hosts.ray.policy", "Hosts are independent"),
    ("hosts/k8s/_probe.py", "import splitserve.hosts.local.launcher", "Hosts are independent"),
    ("decode_worker/service.py", "import grpc", "Role services: dataclass messages, no gRPC"),
    ("prefill_worker/service.py", "import splitserve.common.worker_client", "Role services: dataclass messages, no gRPC"),
    ("vllm_engine/server.py", "import splitserve.vllm_engine.in_vllm.pool_connector", "vLLM engine: beside vLLM"),
    ("vllm_engine/engine.py", "import torch", "vLLM engine: beside vLLM"),
    ("vllm_engine/in_vllm/_probe.py", "import splitserve.vllm_engine.engine", "Inside vLLM: plain splitserve only"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, imports, contract):
    layout = package_layout(tmp_path)
    probe = layout / "splitserve" / module
    probe.write_text(f"{imports}\n" + (probe.read_text() if probe.exists() else ""))  # a module's own, or a probe
    res = lint_imports(layout)
    assert res.returncode != 0
    broken = [line for line in res.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), res.stdout[-3000:]


def test_every_module_beside_vllm_is_under_its_contract():
    """The "beside vLLM" contract names its source modules one by one (what runs inside vLLM is the same package's
    subpackage, which may import vLLM); a new module of vllm_engine/ outside in_vllm/ must join the list."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (beside,) = [c for c in config if c["name"].startswith("vLLM engine: beside vLLM")]
    modules = {f"splitserve.vllm_engine.{p.stem}" for p in (ROOT / "vllm_engine").glob("*.py") if p.stem != "__init__"}
    assert set(beside["source_modules"]) == modules


def test_importing_the_gateway_app_loads_no_torch():
    code = "import sys, splitserve.router.app; print('torch' in sys.modules, 'transformers' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.split() == ["False", "False"], res.stderr


def test_a_serving_gateway_process_never_maps_torch(colocated_one):
    """A real gateway in front of a real colocated worker answers requests; its process never loaded torch's
    native library (read from /proc/<pid>/maps), while the worker's did."""
    up = colocated_one
    body = b'{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}'
    req = urllib.request.Request(up.url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
    gateway = Path(f"/proc/{up.components['router_pid']}/maps").read_text()
    worker = Path(f"/proc/{up.components['decode'][0]['pid']}/maps").read_text()
    assert "libtorch" in worker
    assert "libtorch" not in gateway and "torch/lib" not in gateway
