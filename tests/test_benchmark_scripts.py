"""The benchmark scripts run end to end at toy sizes and end with the JSON line their contract names.
(Speed goals live in the scripts' own output, never in assertions here.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def last_json(cmd: list[str]) -> dict:
    res = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_engine_throughput_contract():
    out = last_json(["benchmarks/engine_throughput.py", "--model", "smollm2", "--num-prompts", "2", "--output-len", "4"])
    assert out["ours_tok_s"] > 0 and out["hf_tok_s"] > 0
    assert abs(out["ratio_vs_hf"] - out["ours_tok_s"] / out["hf_tok_s"]) < 0.01
    assert "vllm_tok_s" in out and "ratio_vs_vllm" in out


def test_kv_transfer_contract():
    out = last_json(["benchmarks/kv_transfer.py", "--backend", "tcp", "--cases", "smollm2_2k", "--reps", "1"])
    assert out["backend"] == "tcp" and out["device"] == "cpu"
    (case,) = out["cases"]
    assert case["name"] == "smollm2_2k" and case["bytes"] == 2 * 30 * 2048 * 3 * 64 * 4
    assert case["verified"] is True
    for key in ("whole_gbps", "layerwise_gbps", "tail_after_last_layer_ms"):
        assert case[key] > 0
