"""`splitserve simulate` with role flips, as a process: the JSON contract holds and a bad flip setting is one line."""

from __future__ import annotations

import pytest
from unit.autoscaler.test_simulator import PROFILE

pytestmark = pytest.mark.slow


def test_simulate_cli_with_flips_keeps_the_json_contract(tmp_path):
    """`splitserve simulate --flips`: the last line holds the contract's keys (and the flips done); the model
    load flag still sets the cold start, simulated and planned alike."""
    import json
    import subprocess
    import sys

    from unit.autoscaler.test_simulator import ROOT

    prof = tmp_path / "toy.json"
    PROFILE.save(prof)
    base = [sys.executable, "-m", "splitserve.cli", "simulate", "--poisson-rate", "20", "--num-requests", "300",
            "--input-len", "600", "--output-len", "40", "--profile", str(prof), "--gpus", "8", "--policy", "slo",
            "--slo-ttft", "1", "--slo-itl", "0.05", "--interval", "1", "--model-load-seconds", "5", "--json"]
    for extra in (["--flips", "--flip-seconds", "2"], ["--no-flips"]):
        res = subprocess.run(base + extra, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-2000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        for key in ("slo_attainment", "feasible_attainment", "gpu_seconds", "oracle_gpu_seconds", "max_gpus"):
            assert key in out, key
        assert out["requests"] == 300 and out["role_flips"] >= 0
        if "--no-flips" in extra:
            assert out["role_flips"] == 0
    bad = subprocess.run(base + ["--flip-seconds", "-1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "flip" in bad.stderr.lower() and "Traceback" not in bad.stderr
