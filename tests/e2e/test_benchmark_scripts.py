"""The benchmark scripts run end to end at toy sizes and end with the JSON line their contract names.
(Speed goals live in the scripts' own output, never in assertions here.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def last_json(cmd: list[str]) -> dict:
    res = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# scripts whose runs are too long for a test (they start whole clusters): their --help at least parses, which imports
# them and their helpers
HELP_ONLY = ["serving_ray.py", "serving_vllm_cpu.py"]


@pytest.mark.parametrize("script", HELP_ONLY)
def test_help(script):
    res = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--save NAME" in res.stdout


def test_engine_throughput_contract():
    out = last_json(["benchmarks/engine_throughput.py", "--model", "smollm2", "--num-prompts", "2", "--output-len", "4"])
    assert out["ours_tok_s"] > 0 and out["hf_tok_s"] > 0
    ours, hf, half = out["ours_tok_s"], out["hf_tok_s"], 0.005  # rates printed to 2 decimals, the ratio from exact
    assert (ours - half) / (hf + half) - 0.01 <= out["ratio_vs_hf"] <= (ours + half) / max(hf - half, 1e-9) + 0.01
    assert "vllm_tok_s" in out and "ratio_vs_vllm" in out


def test_kv_transfer_contract():
    out = last_json(["benchmarks/kv_transfer.py", "--backend", "tcp", "--cases", "smollm2_2k", "--reps", "1"])
    assert out["backend"] == "tcp" and out["device"] == "cpu"
    (case,) = out["cases"]
    assert case["name"] == "smollm2_2k" and case["bytes"] == 2 * 30 * 2048 * 3 * 64 * 4
    assert case["verified"] is True
    for key in ("whole_gbps", "layerwise_gbps", "tail_after_last_layer_ms"):
        assert case[key] > 0


def test_routing_micro_contract():
    out = last_json(["benchmarks/routing.py", "--micro-only", "--json", "--micro-blocks", "5000", "--micro-workers", "8",
                     "--micro-decisions", "50", "--micro-single-records", "500", "--micro-prompt-tokens", "1024"])
    assert out["hit_rate"] == {} and out["ttft_p50_s"] == {}  # keyed by policy; no replay in this mode
    assert out["index_events_per_s"] > 0 and out["decision_p99_ms"] > 0


def test_kv_pool_contract(tmp_path):
    # one two-turn conversation in the Mooncake trace format (its own file: the shared traces need not be here),
    # turns on different workers (round_robin), so the second turn loads the first's blocks from the pool; it
    # comes 4 s later (the first turn's blocks are stored after its prefill, later on a busy machine)
    trace = tmp_path / "two_turns.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]}) + "\n"
                     + json.dumps({"timestamp": 8000, "input_length": 1100, "output_length": 2,
                                   "hash_ids": [7, 8, 9]}) + "\n")
    out = last_json(["benchmarks/kv_pool.py", "--json", "--no-save", "--trace", str(trace), "--window-start", "0",
                     "--window-seconds", "60", "--sample", "1", "--max-input-len", "128", "--max-output-len", "2",
                     "--time-scale", "0.5", "--routing", "round_robin", "--prefill-reps", "1", "--redis-blocks", "8"])
    assert set(out["ttft_p50_s"]) == {"pool", "no_pool"} and all(v > 0 for v in out["ttft_p50_s"].values())
    assert out["tokens_loaded"]["pool"] > 0 and out["tokens_loaded"]["no_pool"] == 0
    assert out["tokens_computed"]["pool"] + out["tokens_loaded"]["pool"] <= out["prompt_tokens"]["pool"]
    assert out["tokens_computed"]["no_pool"] > out["tokens_computed"]["pool"]
    assert out["pool_read_gbps"] > 0 and out["redis_get_gbps"] > 0 and out["load_ms_per_1k_tokens"] > 0
    assert out["failed"] == {"pool": 0, "no_pool": 0}


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_goodput_matrix_plans_each_gpu_count_and_refuses_bad_arguments_in_one_line():
    res = run_script("benchmarks/goodput_matrix.py", "--help")
    assert res.returncode == 0 and "--max-prefill-tokens-while-decoding" in res.stdout
    plans = {}
    for gpus in ("1", "2", "4"):
        res = run_script("benchmarks/goodput_matrix.py", "--dry-run", "--gpus", gpus, "--engines", "native")
        assert res.returncode == 0, res.stderr
        plans[gpus] = json.loads(res.stdout.strip().splitlines()[-1])
    assert [plans[g]["configs"] for g in ("1", "2", "4")] == \
        [["colocated"], ["colocated", "1p1d"], ["colocated", "1p3d", "2p2d"]]
    assert plans["4"]["rates_rps"]["azure_code"] == [2 * r for r in plans["2"]["rates_rps"]["azure_code"]]
    # one engine, one configuration: under ten minutes by the script's own estimate
    one = run_script("benchmarks/goodput_matrix.py", "--dry-run", "--gpus", "2", "--engines", "vllm", "--configs",
                     "1p1d")
    assert json.loads(one.stdout.strip().splitlines()[-1])["estimated_s"] < 600
    for bad, says in ((["--gpus", "2", "--configs", "2p2d"], "--configs: 2p2d"),
                      (["--engines", "sglang"], "unknown 'sglang'"),
                      (["--rates", "azure_code=fast"], "--rates"),
                      (["--traces", "azure_code", "--rates", "azure_conv=1"], "no rate for azure_code"),
                      (["--device", "cpu", "--engines", "vllm"], "--engines: vllm")):
        res = run_script("benchmarks/goodput_matrix.py", "--dry-run", *bad)
        assert res.returncode != 0 and res.stderr.startswith("goodput_matrix: ") and says in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1


def test_goodput_matrix_slices_traces_to_carry_and_checks_they_are_long_enough(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    sample = ROOT / "benchmarks" / "traces" / "azure_conv_2023_48.csv"
    for name in ("azure_conv_2023.csv", "azure_code_2023.csv"):
        (full / name).write_text(sample.read_text())
    res = run_script("benchmarks/goodput_matrix.py", "--trace-dir", str(full), "--write-slices", str(tmp_path / "s"),
                     "--slice-rows", "10")
    assert res.returncode == 0, res.stderr
    lines = (tmp_path / "s" / "azure_code_2023.csv").read_text().splitlines()
    assert len(lines) == 11 and lines[0] == sample.read_text().splitlines()[0]
    # 10 requests cannot feed 3 req/s for 20 s: refused before any cluster starts
    res = run_script("benchmarks/goodput_matrix.py", "--device", "cpu", "--shape", "tiny", "--engines", "native",
                     "--gpus", "1", "--trace-dir", str(tmp_path / "s"))
    assert res.returncode != 0 and "has 10 requests" in res.stderr, res.stderr


def test_autoscaling_search_names_the_same_configs_and_reports_its_results():
    """The law's parameter search: config i is the same draw on every machine (the committed results' first line
    lists them), and `--report` counts, for each config with all eight runs, the shared traces' goals it meets."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import autoscaling_search as search
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    lines = [json.loads(line) for line in search.OUT.read_text().splitlines() if line.strip()]
    assert {int(i): c for i, c in lines[0]["configs"].items()} == {int(i): search.config(int(i))
                                                                  for i in lines[0]["configs"]}
    runs: dict[int, set] = {}
    for r in lines[1:]:
        runs.setdefault(r["cfg"], set()).add((r["trace"], r["cold"]))
    complete = [i for i, seen in runs.items() if len(seen) == len(search.RUNS)]
    out = last_json(["benchmarks/autoscaling_search.py", "--report"])["search"]
    assert out["configs_complete"] == len(complete) and out["configs_drawn"] == len(lines[0]["configs"])
    shared = {f"{t}@{c:g}" for t, c in search.RUNS if t in search.SHARED}
    assert set(out["defaults_meet"]) <= shared and len(out["defaults_meet"]) <= out["most_goals_met"]
    assert all(len(goals) == out["most_goals_met"] and set(goals) <= shared
               for goals in out["configs_meeting_most"].values())
