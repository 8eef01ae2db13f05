"""Every example in docs/ray.md, checked with what runs here: `pip install` names the extra pyproject declares
(and `make test` installs), `splitserve serve-ray --print-config` runs and its output passes Ray's schema,
`serve deploy` is Ray's own command taking that file, `kubectl apply` names the RayService example
(tests/test_ray_app.py checks its serveConfigV2), and the `serve-ray` run itself is the end-to-end test's
(tests/test_ray_serve_e2e.py runs the same command line, with test-only flags added)."""

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

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "ray.md").read_text()


def commands() -> list[list[str]]:
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```", DOC, re.S | re.M):
        out += [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def test_every_command_is_checked(tmp_path: Path) -> None:
    e2e = (ROOT / "tests" / "test_ray_serve_e2e.py").read_text()
    checked = 0
    written: dict[str, str] = {}
    for argv in commands():
        if argv[:2] == ["pip", "install"]:
            assert argv[2] == "splitserve[ray]"
            extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            assert extras["ray"] == ["ray[serve]==2.60.0"]
            assert 'pip install -q -e ".[ray]"' in (ROOT / "Makefile").read_text()
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
        else:
            raise AssertionError(f"docs/ray.md: no check for {shlex.join(argv)}")
        checked += 1
    assert checked == 5


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
