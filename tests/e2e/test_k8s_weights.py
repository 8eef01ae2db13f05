"""deploy/examples/weights: the PersistentVolumeClaim and the download Job that fill the GPU example's model volume.
Every object is valid Kubernetes 1.33 and the Job's pod meets the restricted Pod Security Standard; the Job writes
the directory the GPU example's pods read, through the claim they mount, with an access mode that lets every node
running them mount it; its `hf download` command line parses with the installed huggingface_hub, which the
gateway image it runs carries; its token and caches reach huggingface_hub under a read-only root."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support.pss import pod_templates, violations
from unit.splitserve.test_k8s_cli import render

from e2e.test_dockerfile import _closure, _name
from splitserve.common.config import ImagesSpec
from splitserve.hosts.k8s import names

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WEIGHTS = sorted((ROOT / "deploy/examples/weights").glob("*.yaml"))
GPU_EXAMPLE = ROOT / "deploy/examples/gpu-llama-8b.yaml"
MULTI_NODE = {"ReadWriteMany", "ReadOnlyMany"}


def _objects(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _job(path: Path) -> tuple[dict, dict]:
    """(the Job's pod spec, its one container)."""
    [job] = [o for o in _objects(path) if o["kind"] == "Job"]
    spec = job["spec"]["template"]["spec"]
    [container] = spec["containers"]
    return spec, container


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _mount_of(spec: dict, container: dict, claim: str) -> dict:
    [volume] = [v["name"] for v in spec["volumes"] if (v.get("persistentVolumeClaim") or {}).get("claimName") == claim]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume]
    return mount


def test_there_is_an_example_for_the_gpu_cluster():
    assert [p.name for p in WEIGHTS] == ["llama-3-1-8b.yaml"]


@pytest.mark.parametrize("path", WEIGHTS, ids=[p.stem for p in WEIGHTS])
def test_objects_are_valid_and_the_job_is_restricted(path):
    objects = _objects(path)
    assert {o["kind"] for o in objects} == {"PersistentVolumeClaim", "Job"}
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)
    templates = list(pod_templates(objects))
    assert len(templates) == 1
    for name, template in templates:
        assert violations(template) == [], name
    spec, _ = _job(path)
    assert spec["securityContext"]["runAsUser"] == names.IMAGE_USER  # the images' user: it owns what it writes
    assert spec["securityContext"]["fsGroup"] == names.IMAGE_USER  # ... and may write to a fresh volume


def test_the_job_fills_the_directory_the_gpu_example_reads_through_the_claim_it_mounts():
    path = ROOT / "deploy/examples/weights/llama-3-1-8b.yaml"
    [claim] = [o for o in _objects(path) if o["kind"] == "PersistentVolumeClaim"]
    name = claim["metadata"]["name"]
    spec, container = _job(path)
    written = _mount_of(spec, container, name)
    assert not written.get("readOnly")
    local_dir = _option(container["command"], "--local-dir")

    cluster = yaml.safe_load(GPU_EXAMPLE.read_text())["spec"]
    assert cluster["kubernetes"]["modelVolume"]["persistentVolumeClaim"]["claimName"] == name
    assert cluster["model"]["name"] == local_dir
    # every pod of the cluster that mounts the claim (workers and gateways: the tokenizer) sees the Job's files
    # at the same path, read-only; they run on more than one kind of node, so the claim must mount on many
    readers = []
    for pod_name, template in pod_templates(render(GPU_EXAMPLE)):
        pod = template["spec"]
        if not any((v.get("persistentVolumeClaim") or {}).get("claimName") == name for v in pod.get("volumes", [])):
            continue
        for c in pod["containers"]:
            mount = _mount_of(pod, c, name)
            assert mount["mountPath"] == written["mountPath"] and mount["readOnly"], pod_name
        readers.append((pod_name, tuple(sorted((pod.get("nodeSelector") or {}).items()))))
    assert {n.rsplit("-", 1)[-1] for n, _ in readers} == {"prefill", "decode", "gateway"}
    assert len({selector for _, selector in readers}) > 1
    assert set(claim["spec"]["accessModes"]) & MULTI_NODE


def test_the_download_command_parses_with_the_installed_hf_cli(tmp_path):
    """`hf download ARGS --help` exits 0 only when every option of ARGS exists (click parses them all first)."""
    _, container = _job(ROOT / "deploy/examples/weights/llama-3-1-8b.yaml")
    argv = container["command"]
    assert argv[:2] == ["hf", "download"]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    ok = subprocess.run([str(BIN / "hf"), *argv[1:], "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run([str(BIN / "hf"), *argv[1:], "--no-such-option", "--help"], capture_output=True, timeout=120,
                         env=env)
    assert bad.returncode != 0  # the check above can fail


def test_the_job_runs_an_image_that_has_hf():
    """The Job runs the gateway image the chart defaults to; that image installs pyproject's `gateway` extra, whose
    dependencies bring huggingface_hub, the distribution of the `hf` command."""
    _, container = _job(ROOT / "deploy/examples/weights/llama-3-1-8b.yaml")
    assert container["image"] == ImagesSpec().gateway
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gateway"]
    assert "huggingface-hub" in _closure({_name(r) for r in extra})
    import importlib.metadata as md
    assert {e.name for e in md.distribution("huggingface_hub").entry_points if e.group == "console_scripts"} >= {"hf"}


def test_the_token_and_the_caches_reach_huggingface_hub(monkeypatch, tmp_path):
    """HF_TOKEN (from the Secret) is the token huggingface_hub sends; the caches it writes (HF_HOME, HOME) lie on a
    writable volume, since the root filesystem is read-only."""
    spec, container = _job(ROOT / "deploy/examples/weights/llama-3-1-8b.yaml")
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    for key in ("HF_HOME", "HOME"):
        assert any(Path(env[key]["value"]).is_relative_to(p) for p in writable), key
    script = "import huggingface_hub; print(huggingface_hub.get_token())"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_TOKEN": "hf_from_the_secret",
                              "HF_HOME": str(tmp_path / "hf")})
    assert run.stdout.strip() == "hf_from_the_secret", run.stderr

