"""The image release workflow (.github/workflows/images.yml): on a release tag it builds and pushes the
Dockerfile's three images (the gateway for amd64 and arm64, the CUDA worker and the worker with Ray for amd64)
under the names and version the chart, the configuration model and the KubeRay example default to, after checking
the tag is the package's and the chart's version."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from splitserve.common.config import ImagesSpec
from splitserve.hosts.k8s.chart_values import OperatorValues

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _steps(job: str, action: str) -> list[dict]:
    return [s for s in WORKFLOW["jobs"][job]["steps"] if s.get("uses", "").startswith(action + "@")]


def _matrix() -> dict[str, list[str]]:
    """Each target the workflow builds, with its platforms."""
    return {m["target"]: m["platforms"].split(",") for m in WORKFLOW["jobs"]["image"]["strategy"]["matrix"]["include"]}


def test_runs_on_release_tags_and_may_push_packages():
    triggers = WORKFLOW[True]  # YAML 1.1 reads the key `on` as a boolean
    assert triggers["push"] == {"tags": ["v*"]}
    assert WORKFLOW["permissions"]["packages"] == "write"


def test_builds_the_dockerfile_targets_on_the_platforms_their_bases_allow():
    matrix = _matrix()
    assert set(matrix) == {"gateway", "worker", "worker-ray"}
    for target in matrix:
        assert re.search(rf"^FROM \S+ AS {target}$", DOCKERFILE, re.M)
    assert sorted(matrix["gateway"]) == ["linux/amd64", "linux/arm64"]
    assert matrix["worker"] == ["linux/amd64"]  # the CUDA image: see the workflow's header for why
    assert matrix["worker-ray"] == ["linux/amd64"]  # built on the worker stage
    assert re.search(r"^FROM worker AS worker-ray$", DOCKERFILE, re.M)
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


def test_the_rayservice_example_runs_an_image_the_workflow_pushes():
    """deploy/ray/rayservice.yaml's head and worker pods run the `worker-ray` image under the name and version the
    workflow pushes (ghcr.io/<owner>/<target>:<version>, as the chart's images), whose Ray is the RayService's
    rayVersion: applying the example pulls a published image."""
    service = yaml.safe_load((ROOT / "deploy/ray/rayservice.yaml").read_text())
    ray_cluster = service["spec"]["rayClusterConfig"]
    groups = [ray_cluster["headGroupSpec"], *ray_cluster["workerGroupSpecs"]]
    images = [c["image"] for group in groups for c in group["template"]["spec"]["containers"]]
    assert len(images) == 2
    pushed = {f"ghcr.io/splitserve/{target}:{VERSION}" for target in _matrix()}
    assert set(images) == {f"ghcr.io/splitserve/worker-ray:{VERSION}"} and set(images) <= pushed
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["ray"] == [f"ray[serve]=={ray_cluster['rayVersion']}"]


@pytest.mark.parametrize("tag,ok", [(f"v{VERSION}", True), ("v9.9.9", False)])
def test_the_version_check_refuses_a_tag_that_is_not_the_release(tag, ok):
    [step] = [s for s in WORKFLOW["jobs"]["version"]["steps"] if s.get("name", "").startswith("the tag is")]
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", step["run"]], cwd=ROOT, capture_output=True, text=True,
                            env={"GITHUB_REF_NAME": tag, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert (result.returncode == 0) == ok, result.stdout + result.stderr
