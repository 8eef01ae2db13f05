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


def test_simulate_takes_held_bursts_and_warm_replicas_per_role(tmp_path):
    """`--bursts` and the per-role warm replicas reach the law: each changes what the run costs. The trace is
    clumpy (a request a second, and every 40 s a clump of 60 in 3 s), so its load is never smooth and a held
    law starts nothing for a clump. A value the config refuses is one line naming the flag's field."""
    prof = tmp_path / "toy.json"
    PROFILE.save(prof)
    trace = tmp_path / "clumps.csv"
    rows = [(float(t), 600, 40) for t in range(600)]
    rows += [(40.0 * k + i * 0.05, 2000, 40) for k in range(1, 15) for i in range(60)]
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     + "".join(f"{t},{p},{d}\n" for t, p, d in sorted(rows)))
    base = [sys.executable, "-m", "splitserve.cli", "simulate", "--trace", str(trace), "--profile", str(prof),
            "--gpus", "16", "--policy", "slo", "--slo-ttft", "1", "--slo-itl", "0.05", "--model-load-seconds", "60",
            "--json"]

    def gpu_seconds(*extra: str) -> float:
        res = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout.strip().splitlines()[-1])["gpu_seconds"]

    plain = gpu_seconds()
    warm = gpu_seconds("--warm-prefill-replicas", "3", "--warm-decode-replicas", "0")
    held = gpu_seconds("--warm-prefill-replicas", "3", "--warm-decode-replicas", "0", "--bursts", "hold")
    assert warm > plain
    assert held != warm
    res = subprocess.run([*base, "--bursts", "sometimes"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "bursts" in res.stderr and "sometimes" in res.stderr, res.stderr
