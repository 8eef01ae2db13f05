"""The image release workflow (.github/workflows/images.yml): on a release tag it builds and pushes both of the
Dockerfile's images (the gateway for amd64 and arm64, the CUDA worker for amd64) under the names and version the
chart and the configuration model default to, after checking the tag is the package's and the chart's version."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from splitserve.autoscaler.operator.chart_values import OperatorValues
from splitserve.common.config import ImagesSpec

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _steps(job: str, action: str) -> list[dict]:
    return [s for s in WORKFLOW["jobs"][job]["steps"] if s.get("uses", "").startswith(action + "@")]


def test_runs_on_release_tags_and_may_push_packages():
    triggers = WORKFLOW[True]  # YAML 1.1 reads the key `on` as a boolean
    assert triggers["push"] == {"tags": ["v*"]}
    assert WORKFLOW["permissions"]["packages"] == "write"


def test_builds_both_dockerfile_targets_on_the_platforms_their_bases_allow():
    matrix = {m["target"]: m["platforms"].split(",") for m in WORKFLOW["jobs"]["image"]["strategy"]["matrix"]["include"]}
    assert set(matrix) == {"gateway", "worker"}
    for target in matrix:
        assert re.search(rf"^FROM \S+ AS {target}$", DOCKERFILE, re.M)
    assert sorted(matrix["gateway"]) == ["linux/amd64", "linux/arm64"]
    assert matrix["worker"] == ["linux/amd64"]  # the CUDA image: see the workflow's header for why
    [build] = _steps("image", "docker/build-push-action")
    assert build["with"]["target"] == "${{ matrix.target }}" and build["with"]["platforms"] == "${{ matrix.platforms }}"
    assert build["with"]["push"].startswith("${{ github.event_name == 'push'")
    assert _steps("image", "docker/setup-qemu-action") and _steps("image", "docker/setup-buildx-action")
    [login] = _steps("image", "docker/login-action")
    assert login["with"]["registry"] == "ghcr.io"


def test_pushes_the_images_the_chart_and_the_model_default_to():
    [meta] = _steps("image", "docker/metadata-action")
    assert meta["with"]["images"] == "${{ needs.version.outputs.registry }}/${{ matrix.target }}"
    assert "type=semver,pattern={{version}}" in meta["with"]["tags"]
    images = ImagesSpec()
    for target in ("gateway", "worker"):  # ghcr.io/<owner>/<target>:<version>, owner splitserve upstream
        assert getattr(images, target) == f"ghcr.io/splitserve/{target}:{VERSION}"
    assert OperatorValues().image == images.gateway
    values = yaml.safe_load((ROOT / "charts/splitserve/values.yaml").read_text())
    assert values["operator"]["image"] == images.gateway
    assert values["cluster"]["spec"]["images"] == {"worker": images.worker, "gateway": images.gateway}


@pytest.mark.parametrize("tag,ok", [(f"v{VERSION}", True), ("v9.9.9", False)])
def test_the_version_check_refuses_a_tag_that_is_not_the_release(tag, ok):
    [step] = [s for s in WORKFLOW["jobs"]["version"]["steps"] if s.get("name", "").startswith("the tag is")]
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", step["run"]], cwd=ROOT, capture_output=True, text=True,
                            env={"GITHUB_REF_NAME": tag, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert (result.returncode == 0) == ok, result.stdout + result.stderr
