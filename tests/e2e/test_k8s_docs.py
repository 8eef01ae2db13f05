"""Every example in docs/kubernetes.md, checked with what can run here: `sh` blocks run (splitserve, make) or are
carried out with the real libraries (helm install → Helm's SDK renders it; kubectl apply → the CRD admits it, or
Kubernetes 1.33's schemas and the restricted Pod Security Standard; docker build → the Dockerfile has that stage;
git tag → the release workflow accepts it), `yaml` blocks validate against Kubernetes 1.33, and `console` blocks
(which need a live cluster) name only objects, ports, log lines and metrics the chart, the operator and the
workers have."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from prometheus_client import generate_latest
from support.pss import pod_templates, violations
from unit.deploy.test_k8s_schema import admit

from splitserve.cli import app
from splitserve.common.config import ImagesSpec
from splitserve.hosts.k8s.children import children, owner_reference
from splitserve.hosts.k8s.crd import cluster_crd, crd_yaml, role_crd
from splitserve.hosts.k8s.reconcile import resource_of
from splitserve.hosts.k8s.replicas import Observed, decide, spec_or_scale
from splitserve.kv_transfer import metrics as kv_metrics
from splitserve.vllm_engine.control import KV_TRANSPORT

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "kubernetes.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC, re.S | re.M)


def commands(lang: str) -> list[list[str]]:
    out = []
    for block in blocks(lang):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                out.append(shlex.split(line))
    return out


def helm_install(argv: list[str]) -> list[dict]:
    """`helm install RELEASE CHART [-f VALUES]...`, rendered by Helm's SDK (values files merged in order)."""
    release, chart, rest = argv[2], argv[3], argv[4:]
    values: dict = {}
    for flag, path in zip(rest[::2], rest[1::2], strict=True):
        assert flag == "-f", argv
        values = _merge(values, yaml.safe_load((ROOT / path).read_text()))
    with helm.Chart.load(str(ROOT / chart)) as c:
        manifests = c.render(values, name=release, namespace="default")
    return [d for path, text in manifests.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def operator_objects(cluster: dict) -> list[dict]:
    """What the operator makes of a rendered SplitServeCluster."""
    cluster = {**cluster, "metadata": {**cluster["metadata"], "uid": "u"}}
    resource = resource_of(cluster)
    decision = decide(resource.spec, spec_or_scale(resource.spec, Observed()))
    return children(resource, decision, owner_reference(cluster))


def _values(argv: list[str]) -> dict:
    """The values a `helm install ... -f FILE...` line installs with (files merged in order, over the defaults)."""
    values = yaml.safe_load((ROOT / argv[3] / "values.yaml").read_text())
    for path in argv[5::2]:
        values = _merge(values, yaml.safe_load((ROOT / path).read_text()))
    return values


def _option(argv: list[str], name: str) -> str:
    """`--name VALUE` or `--name=VALUE`."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{shlex.join(argv)}: no {name}")


def _private_registry_values() -> dict:
    """The values of the docs' install from your own registry: the one that names image pull Secrets."""
    installs = [_values(a) for a in commands("sh") if a[:2] == ["helm", "install"]]
    [values] = [v for v in installs if v["operator"].get("imagePullSecrets")]
    return values


def _buildx(argv: list[str], workflow: dict) -> None:
    """`docker buildx build --platform P --target T -t TAG --push .`: a Dockerfile stage, the release workflow's
    platforms for it, and the image the docs' private-registry values run."""
    target, tag, platforms = _option(argv, "--target"), _option(argv, "-t"), _option(argv, "--platform")
    assert re.search(rf"^FROM \S+ AS {target}$", (ROOT / "Dockerfile").read_text(), re.M)
    assert "--push" in argv and argv[-1] == "."
    matrix = {m["target"]: m["platforms"] for m in workflow["jobs"]["image"]["strategy"]["matrix"]["include"]}
    assert platforms == matrix[target]
    values = _private_registry_values()
    assert tag == values["cluster"]["spec"]["images"][target]
    if target == "gateway":
        assert tag == values["operator"]["image"]


def _hf_token_path(home: Path) -> str:
    """Where `hf auth login` writes the token, for a user whose HOME is `home` (huggingface_hub's own default)."""
    script = "from huggingface_hub import constants; print(constants.HF_TOKEN_PATH)"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ["PATH"], "HOME": str(home)})
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def _apply(text: str, applied: dict[tuple[str, str], dict]) -> None:
    """`kubectl apply -f` of a file: CRDs and plain objects validate against Kubernetes 1.33 (pods among them meet
    the restricted standard), SplitServeClusters are admitted by the CRD."""
    for doc in yaml.safe_load_all(text):
        if doc["kind"] == "SplitServeCluster":
            assert admit(cluster_crd(), doc)[1] == []
        else:
            kubernetes_validate.validate(doc, "1.33", strict=True)
            for name, template in pod_templates([doc]):
                assert violations(template) == [], name
        applied[(doc["kind"], doc["metadata"]["name"])] = doc


def _secret_consumers(applied: dict[tuple[str, str], dict], name: str, key: str) -> list[str]:
    """The environment variables of applied pods that read key `key` of Secret `name`."""
    return [e["name"] for _, template in pod_templates(list(applied.values()))
            for c in template["spec"]["containers"] for e in c.get("env", [])
            if ((e.get("valueFrom") or {}).get("secretKeyRef") or {}) == {"name": name, "key": key}]


def _release_tag(tag: str, workflow: dict) -> None:
    """A tag the release workflow runs on and whose version check passes: the package's and the chart's version."""
    assert any(fnmatch.fnmatchcase(tag, p) for p in workflow[True]["push"]["tags"])  # YAML 1.1 reads `on` as True
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((ROOT / "charts/splitserve/Chart.yaml").read_text())
    assert tag == f"v{version}" and chart["appVersion"] == version


def test_sh_examples(tmp_path):
    produced: dict[str, str] = {}
    applied: dict[tuple[str, str], dict] = {}
    secrets: list[tuple[str, str, str]] = []  # generic Secrets created from a file: (name, key, path)
    workflow = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    ran = 0
    for argv in commands("sh"):
        if argv[:2] == ["helm", "install"]:
            kinds = {d["kind"] for d in helm_install(argv)}
            assert {"Deployment", "SplitServeCluster"} <= kinds
        elif argv[:2] == ["docker", "login"]:
            values = _private_registry_values()
            images = [values["operator"]["image"], *values["cluster"]["spec"]["images"].values()]
            assert len(argv) == 3 and all(image.startswith(argv[2] + "/") for image in images), images
        elif argv == ["docker", "buildx", "create", "--use"]:
            steps = workflow["jobs"]["image"]["steps"]  # the builder and emulation the workflow sets up
            assert {s.get("uses", "").split("@")[0] for s in steps} >= {"docker/setup-buildx-action",
                                                                         "docker/setup-qemu-action"}
        elif argv[:3] == ["docker", "buildx", "build"]:
            _buildx(argv, workflow)
        elif argv[:4] == ["docker", "buildx", "imagetools", "create"]:
            mirror, source = _option(argv, "-t"), argv[-1]
            [field] = [f for f, image in ImagesSpec().model_dump().items() if image == source]
            assert mirror == _private_registry_values()["cluster"]["spec"]["images"][field]
        elif argv[:4] == ["kubectl", "create", "secret", "docker-registry"]:
            values = _private_registry_values()
            pull_secrets = (values["operator"]["imagePullSecrets"],
                            values["cluster"]["spec"]["kubernetes"]["imagePullSecrets"])
            assert all(s == [{"name": argv[4]}] for s in pull_secrets)
            server = _option(argv, "--docker-server")
            images = [values["operator"]["image"], *values["cluster"]["spec"]["images"].values()]
            assert all(image.startswith(server + "/") for image in images), images
        elif argv[:4] == ["kubectl", "create", "secret", "generic"]:
            [source] = [a.removeprefix("--from-file=") for a in argv[5:] if a.startswith("--from-file=")]
            key, path = source.split("=", 1)
            secrets.append((argv[4], key, path))
        elif argv[:2] == ["splitserve", "render"]:
            result = CliRunner().invoke(app, argv[1:])
            assert result.exit_code == 0, result.output
            objects = list(yaml.safe_load_all(result.output))
            for obj in objects:
                if obj["kind"] == "SplitServeRole":
                    assert admit(role_crd(), obj)[1] == []
                else:
                    kubernetes_validate.validate(obj, "1.33", strict=True)
            assert {"ConfigMap", "Deployment", "Service"} <= {o["kind"] for o in objects}
        elif argv[:2] == ["splitserve", "crd"]:
            result = CliRunner().invoke(app, argv[1:argv.index(">")] if ">" in argv else argv[1:])
            assert result.exit_code == 0 and result.output == crd_yaml()
            if ">" in argv:
                produced[argv[argv.index(">") + 1]] = result.output
        elif argv[:3] == ["kubectl", "apply", "-f"]:
            _apply(produced.get(argv[3]) or (ROOT / argv[3]).read_text(), applied)
        elif argv[:2] == ["kubectl", "wait"]:
            kind, name = argv[-1].split("/")
            assert kind == "job" and ("Job", name) in applied, f"{argv[-1]} is applied earlier on the page"
            assert _option(argv, "--for") == "condition=complete" and re.fullmatch(r"\d+[smh]", _option(argv, "--timeout"))
        elif argv[:2] == ["git", "tag"]:
            _release_tag(argv[2], workflow)
        elif argv[:3] == ["git", "push", "origin"]:
            _release_tag(argv[3], workflow)
        elif argv[:2] == ["docker", "build"]:
            target, tag = argv[argv.index("--target") + 1], argv[argv.index("-t") + 1]
            assert re.search(rf"^FROM \S+ AS {target}$", (ROOT / "Dockerfile").read_text(), re.M)
            assert tag == getattr(ImagesSpec(), target)
        elif argv == ["make", "k8s-generate"]:
            assert subprocess.run(["make", "-n", "k8s-generate"], cwd=ROOT, capture_output=True).returncode == 0
            spec = importlib.util.spec_from_file_location("generate", ROOT / "deploy" / "generate.py")
            generate = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(generate)
            assert all(path.read_text() == text for path, text in generate.generated().items())
        else:
            raise AssertionError(f"docs/kubernetes.md: no check for {shlex.join(argv)!r}")
        ran += 1
    assert ran >= 10
    # A Secret created from a file is read by an applied pod; a Hugging Face token is the file `hf auth login` writes
    assert secrets
    for name, key, path in secrets:
        consumers = _secret_consumers(applied, name, key)
        assert consumers, f"no applied pod reads Secret {name} key {key}"
        if "HF_TOKEN" in consumers:
            assert path.replace("$HOME", str(tmp_path)) == _hf_token_path(tmp_path)


def test_yaml_examples_are_valid_and_target_what_the_operator_creates():
    [hpa] = [yaml.safe_load(b) for b in blocks("yaml")]
    kubernetes_validate.validate(hpa, "1.33", strict=True)
    install = next(a for a in commands("sh") if a[:2] == ["helm", "install"] and "autoscaling" in " ".join(a))
    [cluster] = [d for d in helm_install(install) if d["kind"] == "SplitServeCluster"]
    assert cluster["spec"]["autoscaling"]["mode"] == "external"
    roles = {o["metadata"]["name"] for o in operator_objects(cluster) if o["kind"] == "SplitServeRole"}
    assert hpa["spec"]["scaleTargetRef"]["name"] in roles


def test_console_examples_name_what_the_default_install_creates():
    [cluster] = [d for d in helm_install(["helm", "install", "splitserve", "charts/splitserve"])
                 if d["kind"] == "SplitServeCluster"]
    services = {o["metadata"]["name"]: o for o in operator_objects(cluster) if o["kind"] == "Service"}
    text = "\n".join(blocks("console"))
    for name, port in re.findall(r"svc/(\S+) \d+:(\d+)", text):
        assert services[name]["spec"]["ports"][0]["port"] == int(port)
    assert f'"model": "{cluster["spec"]["model"]["servedModelName"]}"' in text


def test_console_examples_name_the_gpu_examples_workers_their_log_lines_and_metrics():
    """`kubectl logs deploy/NAME -c C | grep TEXT`: NAME is a Deployment the operator creates for the GPU example,
    C one of its pods' containers and TEXT starts a line the KV connector's control (engine vllm) or the native KV
    transfer logs; `port-forward deploy/NAME L:P` forwards to a port its worker container listens on, and `curl
    .../metrics | grep M` on that local port finds M among the metrics a worker exports."""
    cluster = yaml.safe_load((ROOT / "deploy/examples/gpu-llama-8b.yaml").read_text())
    deployments = {o["metadata"]["name"]: o for o in operator_objects(cluster) if o["kind"] == "Deployment"}
    logged = (ROOT / "kv_transfer/agent.py").read_text() + (ROOT / "vllm_engine/control.py").read_text()
    assert kv_metrics.BYTES and KV_TRANSPORT  # imported: the KV transfer metrics are registered, as in a worker
    exported = generate_latest().decode()
    forwarded: dict[int, str] = {}
    checked = 0
    for line in "\n".join(blocks("console")).splitlines():
        if m := re.search(r"logs deploy/(\S+) -c (\S+) \| grep '([^']+)'", line):
            assert m.group(2) in {c["name"] for c in deployments[m.group(1)]["spec"]["template"]["spec"]["containers"]}
            assert re.search(r'log\.info\("' + re.escape(m.group(3)), logged), m.group(3)
        elif m := re.search(r"port-forward deploy/(\S+) (\d+):(\d+)", line):
            [worker] = [c for c in deployments[m.group(1)]["spec"]["template"]["spec"]["containers"]
                        if c["name"] == "worker"]
            assert int(m.group(3)) in {p["containerPort"] for p in worker["ports"]}
            forwarded[int(m.group(2))] = m.group(1)
        elif m := re.search(r"curl -s http://127\.0\.0\.1:(\d+)/metrics \| grep (\S+)", line):
            assert int(m.group(1)) in forwarded
            assert re.search(rf"^# TYPE {re.escape(m.group(2))}", exported, re.M), m.group(2)
        else:
            continue
        checked += 1
    assert checked == 3


# The NVIDIA driver branch each CUDA major needs at least (CUDA's minor version compatibility).
DRIVER_BRANCH = {12: "R525", 13: "R580"}


def test_the_gpu_node_prerequisites_are_the_worker_images():
    """The page names the worker image's CUDA base and its NIXL build, and the driver branch that CUDA major
    needs: bumping CUDA_IMAGE without the page fails here."""
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    major = int(re.match(r"nvidia/cuda:(\d+)\.", base).group(1))
    assert f"`{base}`" in DOC
    assert f"nixl-cu{major}==" in (ROOT / "Makefile").read_text()  # what install-worker installs
    assert f"`nixl-cu{major}`" in DOC
    assert f"branch {DRIVER_BRANCH[major]} or newer (CUDA {major}.x's minimum" in DOC


def test_the_release_section_is_what_the_workflow_publishes():
    workflow = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    release = DOC[DOC.index("## The release"):DOC.index("## Build and push your own")]
    for m in workflow["jobs"]["image"]["strategy"]["matrix"]["include"]:
        assert f"`{m['target']}`" in release
    [meta] = [s for s in workflow["jobs"]["image"]["steps"] if s.get("uses", "").startswith("docker/metadata-action@")]
    shown = {"type=semver,pattern={{version}}": "`X.Y.Z`", "type=semver,pattern={{major}}.{{minor}}": "`X.Y`",
             "type=sha": "`sha-<commit>`"}
    assert {line.strip() for line in meta["with"]["tags"].splitlines() if line.strip()} == set(shown)
    assert all(text in release for text in shown.values())
    # "no tag yet" holds only while the release's tag is absent from this clone
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    tags = subprocess.run(["git", "tag", "--list", "v*"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if f"v{version}" in tags:
        assert "No tag has been pushed yet" not in release
