"""Every example in docs/kubernetes.md, checked with what can run here: `sh` blocks run (splitserve, make) or are
carried out with the real libraries (helm install → Helm's SDK renders it; kubectl apply → the CRD admits it;
docker build → the Dockerfile has that stage), `yaml` blocks validate against Kubernetes 1.33, and `console`
blocks (which need a live cluster) name only objects the chart and the operator create."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml
from click.testing import CliRunner
from test_k8s_schema import admit

from splitserve.autoscaler.operator.children import children, owner_reference
from splitserve.autoscaler.operator.crd import cluster_crd, crd_yaml, role_crd
from splitserve.autoscaler.operator.reconcile import resource_of
from splitserve.autoscaler.operator.replicas import Observed, decide, spec_or_scale
from splitserve.cli import app
from splitserve.common.config import ImagesSpec

ROOT = Path(__file__).resolve().parents[1]
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


def test_sh_examples(tmp_path):
    produced: dict[str, str] = {}
    workflow = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    ran = 0
    for argv in commands("sh"):
        if argv[:2] == ["helm", "install"]:
            kinds = {d["kind"] for d in helm_install(argv)}
            assert {"Deployment", "SplitServeCluster"} <= kinds
        elif argv[:3] == ["docker", "buildx", "build"]:
            _buildx(argv, workflow)
        elif argv[:4] == ["docker", "buildx", "imagetools", "create"]:
            mirror, source = _option(argv, "-t"), argv[-1]
            assert source == ImagesSpec().redis
            assert mirror == _private_registry_values()["cluster"]["spec"]["images"]["redis"]
        elif argv[:4] == ["kubectl", "create", "secret", "docker-registry"]:
            values = _private_registry_values()
            secrets = (values["operator"]["imagePullSecrets"], values["cluster"]["spec"]["kubernetes"]["imagePullSecrets"])
            assert all(s == [{"name": argv[4]}] for s in secrets)
            server = _option(argv, "--docker-server")
            images = [values["operator"]["image"], *values["cluster"]["spec"]["images"].values()]
            assert all(image.startswith(server + "/") for image in images), images
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
            text = produced.get(argv[3]) or (ROOT / argv[3]).read_text()
            for doc in yaml.safe_load_all(text):
                if doc["kind"] == "CustomResourceDefinition":
                    kubernetes_validate.validate(doc, "1.33", strict=True)
                else:
                    assert admit(cluster_crd(), doc)[1] == []
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
