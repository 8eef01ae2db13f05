"""Fitting a `ReplicaProfile` to measured engine step times.

Two sources:
- `fit_gpu_profile`: the committed H200 results (benchmarks/results/gpu_engine_nvidia_h200.json: an 8B-shaped
  model's decode step at batch 1..128 and prefill tokens/s at 2k and 8k) plus the measured KV transfer. Six
  points do not pin six coefficients, so the fit takes two from physics measured in the same run: the weight
  read (weight bytes / copy bandwidth) and the KV read per context token (KV bytes / the copy bandwidth at the
  bandwidth utilisation measured at batch 128).
- `fit_points`: step times measured here on the CPU (`splitserve simulate --calibrate`), least squares over
  the step formula with the knee searched on a grid.
The engine is measured elsewhere (splitserve/cli_simulate.py): the autoscaler imports no engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.autoscaler.profile import ReplicaProfile, StepCost, attn_pairs

# Llama-3.1-8B shape (benchmarks/gpu_engine.py LLAMA8B), bf16
LLAMA8B_WEIGHT_BYTES = 16_060_522_496  # 8.03e9 parameters x 2 bytes
LLAMA8B_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x bytes = 131072
H200_MEMORY_BYTES = 139 * 2**30  # usable GPU memory as torch reports it


@dataclass(frozen=True)
class StepPoint:
    """One measured engine step (or a median of several): what was in it and how long it took."""

    num_seqs: int
    num_tokens: int
    ctx_tokens: int  # KV tokens read by decoding sequences
    attn_pairs: float  # prefill attention (query, key) pairs
    seconds: float

    @classmethod
    def decode(cls, batch: int, context: int, seconds: float) -> StepPoint:
        return cls(batch, batch, batch * context, 0.0, seconds)

    @classmethod
    def prefill(cls, tokens: int, seconds: float, past: int = 0, seqs: int = 1) -> StepPoint:
        per = tokens // seqs
        return cls(seqs, tokens, 0, seqs * attn_pairs(per, past), seconds)


def fit_gpu_profile(gpu_results: dict[str, Any], kv_case: dict[str, Any], *, name: str = "llama8b-h200",
                    weight_bytes: int = LLAMA8B_WEIGHT_BYTES, kv_bytes_per_token: int = LLAMA8B_KV_BYTES_PER_TOKEN,
                    memory_bytes: int = H200_MEMORY_BYTES, max_num_seqs: int = 128, budget: int = 2048,
                    cold_start_seconds: dict[str, float] | None = None, prefill_steps: list[StepPoint] = ()) -> ReplicaProfile:
    """The 8B-shaped profile from gpu_engine results and one kv_transfer case (both as committed JSON), and
    measured chunked-prefill steps (`prefill_steps`: prompt chunks after a past context) when there are some."""
    bw = gpu_results["copy_gbps"] * 1e9  # bytes/s, read + write counted
    dec = sorted(gpu_results["decode"], key=lambda r: r["batch"])
    ctx = dec[0]["context"]
    xs = np.array([r["batch"] for r in dec], float)
    ys = np.array([r["step_ms"] / 1e3 for r in dec])
    slope, intercept = np.polyfit(xs, ys, 1)  # s per sequence, s
    weights_s = weight_bytes / bw
    bw_util = dec[-1]["bw_util"]  # at the largest batch, where KV reads matter most
    per_ctx = kv_bytes_per_token / bw / bw_util
    per_seq = max(0.0, slope - per_ctx * ctx)
    base = intercept - weights_s
    prefill = [StepPoint.prefill(r["tokens"], r["tokens"] / r["tok_s"]) for r in gpu_results["prefill"]]
    prefill += list(prefill_steps)
    y = np.array([p.seconds for p in prefill])
    rows = np.array([[p.num_tokens, p.attn_pairs] for p in prefill])
    rhs = y - base - per_seq * np.array([p.num_seqs for p in prefill])
    # relative error: a 50 ms step counts as much as a 200 ms one
    (per_token, per_attn), *_ = np.linalg.lstsq(rows / y[:, None], rhs / y, rcond=None)
    cost = StepCost(base_s=float(base), per_seq_s=float(per_seq), per_token_s=float(per_token),
                    knee_tokens=float(weights_s / per_token), per_ctx_token_s=float(per_ctx),
                    per_attn_pair_s=float(per_attn))
    activations = 4 * 2**30  # bytes kept free for activations and CUDA graphs
    kv_capacity = int((0.9 * memory_bytes - weight_bytes - activations) / kv_bytes_per_token)
    points = [StepPoint.decode(r["batch"], r["context"], r["step_ms"] / 1e3) for r in dec] + prefill
    return ReplicaProfile(
        name=name, cost=cost, kv_capacity_tokens=kv_capacity, kv_bytes_per_token=kv_bytes_per_token,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        kv_transfer_gbps=kv_case["layerwise_gbps"], kv_transfer_tail_s=kv_case["tail_after_last_layer_ms"] / 1e3,
        cold_start_seconds=cold_start_seconds or {"native": 60.0},
        source={"device": gpu_results.get("device"),
                "fit": "physics prior (weights, KV read) + decode line; prefill by least squares"
                       + (f" over {len(prefill)} steps (with {len(prefill_steps)} chunked ones)" if prefill_steps else ""),
                "kv_case": kv_case.get("name"), "errors": fit_errors(cost, points),
                "kv_capacity_note": "0.9 of GPU memory - weights - 4 GiB, in tokens (an assumption, not measured)"})


def fit_points(points: list[StepPoint]) -> StepCost:
    """Least-squares step cost for measured points (non-negative coefficients, knee on a grid)."""
    best: tuple[float, StepCost] | None = None
    y = np.array([p.seconds for p in points])
    for knee in [0.0, *np.geomspace(1, 4096, 25)]:
        x = np.array([[1.0, p.num_seqs, max(p.num_tokens, knee), p.ctx_tokens, p.attn_pairs] for p in points])
        coef = _nnls(x / y[:, None], np.ones(len(points)))  # relative error: short steps count as much as long
        c = [float(v) for v in coef]
        cost = StepCost(c[0], c[1], c[2], float(knee), c[3], c[4])
        err = float(np.sum(((x @ coef) / y - 1) ** 2))
        if best is None or err < best[0]:
            best = (err, cost)
    assert best is not None
    return best[1]


def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 50) -> np.ndarray:
    """Non-negative least squares by dropping negative coefficients (enough for five columns)."""
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    for _ in range(iters):
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active = [c for c, v in zip(active, sol, strict=True) if v >= 0]
    return coef


def fit_errors(cost: StepCost, points: list[StepPoint]) -> list[dict[str, float]]:
    """Each point's measured and fitted seconds and the relative error."""
    out = []
    for p in points:
        fitted = cost.seconds(p.num_seqs, p.num_tokens, p.ctx_tokens, p.attn_pairs)
        out.append({"num_seqs": p.num_seqs, "num_tokens": p.num_tokens, "ctx_tokens": p.ctx_tokens,
                    "measured_s": round(p.seconds, 6), "fitted_s": round(fitted, 6),
                    "error": round(fitted / p.seconds - 1, 4)})
    return out


def measured_prefill_steps(path: str | Path) -> list[StepPoint]:
    """The chunked-prefill steps of a `benchmarks/autoscaling.py --measure-gpu` file (its first step is a warm-up;
    its decode points are not used: see the file's notes)."""
    points = [p for p in json.loads(Path(path).read_text())["points"] if p["kind"] == "prefill"][1:]
    return [StepPoint(p["num_seqs"], p["num_tokens"], p["ctx_tokens"], p["attn_pairs"], p["seconds"]) for p in points]


def kv_case(path: str | Path, name: str) -> dict[str, Any]:
    """One case of a kv_transfer result file (its last line is the JSON)."""
    data = json.loads(Path(path).read_text().strip().splitlines()[-1])
    return next(c for c in data["cases"] if c["name"] == name)
