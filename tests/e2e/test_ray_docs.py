"""Every example in docs/ray.md, checked with what runs here: `pip install -e` names the extra pyproject declares
(and `make test` installs), `splitserve serve-ray --print-config` runs and its output passes Ray's schema,
`serve deploy` is Ray's own command taking that file, `kubectl apply` names the RayService example
(tests/unit/hosts/test_ray_app.py checks its serveConfigV2), `docker build` builds a Dockerfile stage under the image that
example runs (and `docker buildx build` on the platforms the release workflow builds it for), and the `serve-ray`
run itself is the end-to-end test's (tests/e2e/test_ray_serve_e2e.py runs the same command line, with test-only flags
added)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")
from ray.serve.schema import ServeDeploySchema  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "ray.md").read_text()
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def commands() -> list[list[str]]:
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```", DOC, re.S | re.M):
        out += [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def _rayservice_images() -> set[str]:
    """The images the RayService example's head and worker pods run."""
    service = yaml.safe_load((ROOT / "deploy/ray/rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = [service["headGroupSpec"], *service["workerGroupSpecs"]]
    return {c["image"] for group in groups for c in group["template"]["spec"]["containers"]}


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_command_is_checked(tmp_path: Path) -> None:
    e2e = (ROOT / "tests" / "e2e" / "test_ray_serve_e2e.py").read_text()
    workflow = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    platforms = {m["target"]: m["platforms"] for m in workflow["jobs"]["image"]["strategy"]["matrix"]["include"]}
    checked = 0
    written: dict[str, str] = {}
    for argv in commands():
        if argv[:2] == [".venv/bin/pip", "install"]:
            assert argv[2:4] == ["-e", ".[ray]"]  # from the checkout: splitserve is not on PyPI
            extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            assert extras["ray"] == ["ray[serve]==2.60.0"]
            installed = re.search(r'pip install -q -e "\.\[([^\]]*)\]"', (ROOT / "Makefile").read_text())
            assert "ray" in installed.group(1).split(",")  # `make test`'s venv has the extra
        elif argv[0] == ".venv/bin/splitserve" and "--print-config" in argv:
            out_file = argv[argv.index(">") + 1] if ">" in argv else None
            args = argv[1:argv.index(">")] if out_file else argv[1:]
            res = subprocess.run([sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True,
                                 cwd=ROOT, check=True)
            ServeDeploySchema.model_validate(yaml.safe_load(res.stdout))
            if out_file:
                written[out_file] = res.stdout
        elif argv[0] == ".venv/bin/splitserve":
            assert argv[1:3] == ["serve-ray", "-f"] and argv[3] == "deploy/examples/local-cpu.yaml"
            assert '"serve-ray", "-f", str(ROOT / "deploy/examples/local-cpu.yaml"), "--port"' in e2e
        elif argv[:2] == ["serve", "deploy"]:
            from ray.serve.scripts import cli

            assert "deploy" in cli.commands  # Ray's CLI, which validates the file with the same schema
            ServeDeploySchema.model_validate(yaml.safe_load(written[argv[2]]))
        elif argv[:3] == ["kubectl", "apply", "-f"]:
            docs = list(yaml.safe_load_all((ROOT / argv[3]).read_text()))
            assert [d["kind"] for d in docs] == ["RayService"]
        elif argv[:2] == ["docker", "build"]:  # the image the example runs, as the release workflow names it
            target = _option(argv, "--target")
            assert re.search(rf"^FROM \S+ AS {target}$", DOCKERFILE, re.M) and argv[-1] == "."
            assert {_option(argv, "-t")} == _rayservice_images() and target in platforms
        elif argv[:3] == ["docker", "buildx", "build"]:  # your own build: the same stage, the workflow's platforms
            target = _option(argv, "--target")
            assert re.search(rf"^FROM \S+ AS {target}$", DOCKERFILE, re.M)
            assert "--push" in argv and argv[-1] == "."
            assert _option(argv, "--platform") == platforms[target]
            assert {image.rsplit("/", 1)[1].split(":")[0] for image in _rayservice_images()} == {target}
        else:
            raise AssertionError(f"docs/ray.md: no check for {shlex.join(argv)}")
        checked += 1
    assert checked == 7


def test_readme_serve_ray_example() -> None:
    """The README's `serve-ray` line: valid (its Serve config passes Ray's schema) and what the end-to-end test
    runs."""
    text = (ROOT / "README.md").read_text()
    found = [shlex.split(line)[1:] for block in re.findall(r"```sh\n(.*?)```", text, re.S)
             for line in block.splitlines() if line.startswith(".venv/bin/splitserve serve-ray")]
    assert found, "README lost its serve-ray example"
    for args in found:
        res = subprocess.run([sys.executable, "-m", "splitserve.cli", *args, "--print-config"], capture_output=True,
                             text=True, cwd=ROOT, check=True)
        ServeDeploySchema.model_validate(yaml.safe_load(res.stdout))
        assert args[:3] == ["serve-ray", "-f", "deploy/examples/local-cpu.yaml"]
