"""`splitserve simulate` as a process: the CLI's JSON contract and the docs' examples."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from unit.autoscaler.test_simulator import PROFILE, ROOT, TRACES

pytestmark = pytest.mark.slow


def test_simulate_cli_ends_with_the_json_contract(tmp_path):
    prof = tmp_path / "toy.json"
    PROFILE.save(prof)
    cmd = [sys.executable, "-m", "splitserve.cli", "simulate", "--poisson-rate", "20", "--num-requests", "300",
           "--input-len", "600", "--output-len", "40", "--profile", str(prof), "--gpus", "8", "--policy", "slo",
           "--slo-ttft", "1", "--slo-itl", "0.05", "--interval", "1", "--model-load-seconds", "5", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("slo_attainment", "gpu_seconds", "oracle_gpu_seconds", "requests"):
        assert key in out, key
    assert out["requests"] == 300 and 0.0 <= out["slo_attainment"] <= 1.0
    assert out["gpu_seconds"] > 0 and out["oracle_gpu_seconds"] > 0


@pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not here")
def test_the_docs_examples_run(tmp_path):
    import re
    import shlex

    text = (ROOT / "docs" / "autoscaling.md").read_text()
    commands = [c for block in re.findall(r"```sh\n(.*?)```", text, re.S)
                for c in block.replace("\\\n", " ").splitlines() if "splitserve simulate" in c]
    assert len(commands) == 2
    try:
        import matplotlib  # noqa: F401
        has_plot = True
    except ImportError:
        has_plot = False
    for command in commands:
        args = shlex.split(command)[2:]  # after .venv/bin/splitserve simulate
        args = [str(tmp_path / a) if a.endswith(".png") else a for a in args]
        res = subprocess.run([sys.executable, "-m", "splitserve.cli", "simulate", *args], capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
        if "--plot" in args and not has_plot:
            assert res.returncode == 2 and "matplotlib" in res.stderr
            continue
        assert res.returncode == 0, res.stderr[-2000:]
        if "--json" in args:
            out = json.loads(res.stdout.strip().splitlines()[-1])
            assert {"slo_attainment", "gpu_seconds", "oracle_gpu_seconds", "requests"} <= set(out)
        if "--plot" in args:
            assert (tmp_path / "timelines.png").stat().st_size > 0
