"""The Kubernetes commands from the installed `splitserve`: `render`'s contract, and `operator` without
credentials is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from unit.splitserve.test_k8s_cli import ROOT

pytestmark = pytest.mark.slow


BIN = Path(sys.executable).parent


def test_render_contract_from_the_installed_command():
    """`splitserve render -f FILE` prints a YAML stream of Kubernetes objects (the real entry point)."""
    result = subprocess.run([str(BIN / "splitserve"), "render", "-f", "deploy/examples/gpu-llama-8b.yaml"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert docs and all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)
    missing = subprocess.run([str(BIN / "splitserve"), "render", "-f", "no/such/file.yaml"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1 and "no/such/file.yaml" in missing.stderr


def test_operator_without_credentials_is_one_line_and_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}  # not in a pod
    env.update(KUBECONFIG="/nonexistent", HOME=str(tmp_path))
    result = subprocess.run([str(BIN / "splitserve"), "operator", "--namespace", "default"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("splitserve: error: no Kubernetes credentials") and "kubeconfig" in line
    assert result.stdout == ""
