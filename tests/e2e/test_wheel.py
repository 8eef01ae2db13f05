"""The wheel is the product: built from this checkout, installed into fresh virtualenvs with the Makefile targets the
images run (`install-worker`, `install-gateway`), it imports every module it ships and serves, from a directory
outside the checkout, with nothing of the source tree on the path.

Torch goes into the worker's virtualenv first, as the version this suite runs (the Makefile's CPU build): on a
GPU image `install-worker` takes PyPI's CUDA build instead, gigabytes that change nothing of what is checked here.
Its files are this suite's own, hard-linked (`_link_torch`): what pip would unpack from the same wheel, in a
second instead of twenty. Pip installs without byte-compiling (`PIP_FLAGS=--no-compile`): compiling every file of
every dependency took 26 of the worker install's 36 s here; Python compiles what the checks import as they import it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import openai
import pytest
import torch
from support.serving import Up

from e2e.test_dockerfile import package_roots
from splitserve.common.proc import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Modules that need what only some installs have, and the one distribution each may miss: the GPU kernels need
# Triton (CUDA builds of torch bring it), `serve-ray` needs the `ray` extra, and the KV pool connector runs inside
# a vLLM server's processes.
NEEDS = {
    "splitserve.engine.kernels.triton_moe": "triton",
    "splitserve.engine.kernels.triton_norm_rope": "triton",
    "splitserve.engine.kernels.triton_paged_attention": "triton",
    "splitserve.hosts.ray.app": "ray",
    "splitserve.vllm_engine.in_vllm.layerwise_connector": "vllm",
    "splitserve.vllm_engine.in_vllm.pool_connector": "vllm",
}
# What the slim gateway/operator image runs (the Dockerfile's gateway stage).
GATEWAY_MODULES = ["splitserve.cli", "splitserve.router.app", "splitserve.router.gateway",
                   "splitserve.hosts.k8s.run"]

IMPORT_ALL = """
import importlib, json, sys
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        failed[name] = e.name
print(json.dumps({"failed": failed, "file": importlib.import_module("splitserve").__file__,
                  "torch": "torch" in sys.modules}))
"""


def _run(cmd: list[str], cwd: Path, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kw)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), "."],
         cwd=ROOT)
    (found,) = dist.glob("splitserve-*.whl")
    return found


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until the gateway at `url` answers /health with some decode worker up; fails if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-2000:] if proc.stderr else ""
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"the gateway at {url} did not become healthy within {timeout:.0f} s")


def _modules(wheel: Path) -> list[str]:
    names = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("splitserve/") and n.endswith(".py")]
    return sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names)


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", str(path)], cwd=ROOT)
    return path / "bin"


def _link_torch(bin_: Path) -> None:
    """This suite's torch (its packages and its dist-info) hard-linked into the virtualenv of `bin_`, then pip
    adds what it requires; where the two trees cannot share files, pip installs it from the local wheel."""
    src = Path(torch.__file__).resolve().parents[1]
    site = Path(_run([str(bin_ / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=src).stdout.strip())
    names = ["torch", "torchgen", "functorch", f"torch-{torch.__version__}.dist-info"]
    try:
        for n in names:
            if (src / n).exists():
                shutil.copytree(src / n, site / n, copy_function=os.link)
    except OSError:  # shutil.Error too: another file system
        for n in names:
            shutil.rmtree(site / n, ignore_errors=True)
    _run([str(bin_ / "python"), "-m", "pip", "install", "-q", f"torch=={torch.__version__}",
          "--no-compile"], cwd=site)


def _install(target: str, venv: Path, wheel: Path) -> None:
    _run(["make", target, f"VENV={venv}", f"WHEEL={wheel}", f"PYTHON={sys.executable}",
          "PIP_FLAGS=--no-compile"], cwd=ROOT)


def test_the_wheel_ships_every_module_of_the_tree(wheel):
    """Every Python file of the package folders is in the wheel (packages are discovered, none listed by hand),
    with the package data the code reads."""
    tree = set()
    for package, folder in package_roots().items():
        for path in (ROOT / folder).rglob("*.py"):
            tree.add(".".join([package, *path.relative_to(ROOT / folder).with_suffix("").parts]))
    shipped = set(_modules(wheel))
    assert {m.removesuffix(".__init__") for m in tree} == shipped
    files = set(zipfile.ZipFile(wheel).namelist())
    assert {"splitserve/autoscaler/profiles/h200_8b.json", "splitserve/autoscaler/profiles/cpu2_smollm2.json",
            "splitserve/common/protocol/splitserve.proto"} <= files


@pytest.mark.timeout(1200)
def test_the_worker_install_imports_everything_and_serves_from_outside_the_checkout(wheel, tmp_path):
    bin_ = _venv(tmp_path / "worker")
    _link_torch(bin_)
    _install("install-worker", tmp_path / "worker", wheel)
    away = tmp_path / "elsewhere"
    away.mkdir()
    modules = _modules(wheel)
    probe = _run([str(bin_ / "python"), "-c", IMPORT_ALL, json.dumps(modules)], cwd=away, timeout=600)
    report = json.loads(probe.stdout)
    assert report["file"].startswith(str(tmp_path / "worker")), report["file"]  # the installed copy
    assert report["failed"] == {m: d for m, d in NEEDS.items() if m in report["failed"]}, report["failed"]
    assert set(NEEDS) - set(report["failed"]) <= {m for m in NEEDS if NEEDS[m] == "triton"}  # only CUDA has it

    # `splitserve up` run from the checkout's root would find its source folder `./splitserve` first if any child
    # were started with the working directory on sys.path: every child starts through the installed entry point.
    for cwd in (away, ROOT):
        up = Up("--model", "smollm2", "--prefill", "1", "--decode", "1", "--mode", "disaggregated",
                exe=bin_ / "splitserve", cwd=cwd)
        try:
            client = openai.OpenAI(base_url=up.url + "/v1", api_key="none")
            reply = client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": "Hello!"}])
            assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        finally:
            assert up.stop() == 0, "".join(up.stderr[-20:])


def test_the_gateway_install_has_no_torch_and_serves(wheel, tmp_path):
    """`install-gateway` (the slim image): the wheel without its dependencies and the `gateway` extra. No torch;
    the gateway and operator modules import; its `splitserve router` serves a chat completion in front of
    workers of this suite's install."""
    bin_ = _venv(tmp_path / "gateway")
    _install("install-gateway", tmp_path / "gateway", wheel)
    away = tmp_path / "elsewhere"
    away.mkdir()
    assert subprocess.run([str(bin_ / "python"), "-c", "import torch"], cwd=away, capture_output=True,
                          timeout=60).returncode != 0
    probe = _run([str(bin_ / "python"), "-c", IMPORT_ALL, json.dumps(GATEWAY_MODULES)], cwd=away, timeout=300)
    report = json.loads(probe.stdout)
    assert report == {"failed": {}, "file": report["file"], "torch": False}
    assert report["file"].startswith(str(tmp_path / "gateway"))

    up = Up("--model", "smollm2", "--mode", "colocated", "--decode", "1")
    port = free_port()
    router = subprocess.Popen([str(bin_ / "splitserve"), "router", "--config", up.components["config"],
                               "--host", "127.0.0.1", "--port", str(port)], cwd=away, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ""})
    try:
        _wait_ready(f"http://127.0.0.1:{port}", router)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Hello!"}])
        assert reply.choices[0].message.content
    finally:
        router.terminate()
        _, err = router.communicate(timeout=60)
        up.stop()
    assert "Traceback" not in err, err[-2000:]
