"""The SLO autoscaler against the oracle, the best static P:D and the anchors' laws, on the three shared traces and
a generated bursty, prefill-heavy one (autoscaler/sim/bursty.py, seed 0), in the simulator with 8B-shaped costs
(and the simulator against a real `splitserve up` on this CPU).

  --measure-gpu on a GPU: our engine's step times for an 8B-shaped model (dummy weights, serving settings: token
                budget 2048, 128 seqs) at 1k..16k contexts, chunked prefill up to 32k tokens, and the engine's
                build time -> $OUT or results/sim_calibration_h200_8b_steps.json
  --fit-gpu     fit the 8B-shaped H200 profile from the committed GPU results (and the --measure-gpu steps when
                present) -> autoscaler/profiles/h200_8b.json
  --calibrate   measure our engine's step times here (`splitserve simulate --calibrate`) -> autoscaler/profiles/cpu2_smollm2.json
  --validate    `splitserve up` (1 prefill + 1 decode) under `splitserve bench` (Poisson, then a trace slice), the
                same requests simulated with the CPU profile: TTFT and ITL p50/p90 side by side (goal: within 15%)
  (default)     for each trace at its scale: the oracle (cheapest static P:D per 5-minute window), the best static
                P:D, the SLO law, Ray Serve LLM's, llm-d WVA's and Dynamo's load-mode law: SLO attainment,
                GPU-seconds against the oracle's, a table and a last JSON line; results/autoscaling_<trace>.json
  --rebalance   each trace at each --cold-starts (20 s and 150 s: an H200's native and vllm engines), with role flips
                and without, for the SLO law and Ray's, WVA's and Dynamo's, beside the oracle and the best static
                -> results/autoscaling_rebalance_<trace>.json (a table per trace, the goals in the last JSON line)
  --bound --rebalance  the bursty trace's onset-blind reference at each --cold-starts: as it was, with the
                actuator's flips, and planning its split a flip ahead (--bound-window: its plan windows, 10 s)
                -> results/autoscaling_bound_rebalance.json (other windows: _w<s>.json); with --causal, the
                reference with no head start over a law: it knows a burst only once it began a cold start
                before the window's replicas are asked for -> results/autoscaling_bound_causal.json
  --robustness  each --only law (default slo) under five other seeds, a profile 20% off either way and cold
                starts of 30 s and 120 s -> results/autoscaling_robustness.{md,json} (JSON lines, the summary last)
  --bound       the bursty trace (or each --traces trace, its clumps standing for bursts) against references that
                follow per-30-s plans with a standing margin: one knows the future, one knows all but each
                burst's first cold start (60, 30, 15 s), a bound on any law that reads only the past
                -> results/autoscaling_bound.json (bursty), results/autoscaling_bound_<trace>.json
  --ratchet     each --traces trace's clumps, its start pair held throughout, and ratchets that add replicas after
                every window (2, 5, 10 min) under 95% attainment and never remove any: what learning a standing
                capacity from the past costs -> results/autoscaling_ratchet.json
Runs are spread over --jobs processes (each rebuilds its requests from the trace: same seed, same requests).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import RESULTS, TRACES, Cluster, out_path

from splitserve.autoscaler.profile import PROFILE_DIR

GPU_PROFILE = PROFILE_DIR / "h200_8b.json"
GPU_STEPS = RESULTS / "sim_calibration_h200_8b_steps.json"
CPU_PROFILE = PROFILE_DIR / "cpu2_smollm2.json"
# s from start to ready on an H200 (random weights; main at afe4338): native 13-19 s, vllm 99-148 s (torch.compile,
# CUDA graphs); the profile plans with the top of each range, rounded up for reading 16 GB of real weights
H200_COLD_STARTS = {"native": 20.0, "vllm": 150.0}
H200_COLD_START_NOTE = ("cold starts: the top of what an H200 measured from start to ready with random weights "
                        "(native 13-19 s, vllm 99-148 s: torch.compile and CUDA graphs), rounded up for reading 16 GB "
                        "of weights; flip_seconds: an assumption (re-registration and the gateways' view; a flipping "
                        "worker's drain is its own requests')")


@dataclass(frozen=True)
class TraceCase:
    name: str
    file: str  # under TRACES, or "generated:bursty" (autoscaler/sim/bursty.py, seed 0)
    rate_scale: float  # requests replayed per trace request: sets the cluster size (8..64 GPUs)
    max_input: int = 131072


CASES = {
    "azure_conv": TraceCase("azure_conv", "azure_conv_2023.csv", 32.0),
    "azure_code": TraceCase("azure_code", "azure_code_2023.csv", 10.0),
    "mooncake": TraceCase("mooncake", "mooncake_conversation.jsonl", 3.0),
    "bursty": TraceCase("bursty", "generated:bursty", 16.0),
}
POLICIES = ("slo", "slo_warm2", "ray", "wva", "dynamo", "late_oracle1", "late_oracle3", "late_oracle_all")
# slo_warm2: the same law with autoscaling.warmReplicas 2; late_oracleN: the oracle's largest plan of the N windows
# before each window (all: every window so far), a reference for what reading the past better could give
COLD = ("slo@2x2", "ray@2x2", "wva@2x2", "dynamo@2x2")  # the same laws from a small start (a fresh deployment)
TARGET = 0.95
JOIN_QUANTUM_S = 0.02  # decode joins at most 20 ms late (fewer events; see autoscaler/sim/worker.py)


# -- one experiment, rebuilt in each process ------------------------------------------------------------------
def trace_rows(case: TraceCase):
    from splitserve.autoscaler.sim import bursty, trace

    if case.file == "generated:bursty":
        return bursty.generate(bursty.BurstyConfig(max_prompt=case.max_input), seed=0)[0]
    return trace.read_trace(TRACES / case.file, max_input=case.max_input)


def experiment(case: TraceCase, duration: float | None, gpus: int, seed: int = 0, cold_start_s: float = 60.0,
               flips: bool = False):
    from splitserve.autoscaler.profile import ReplicaProfile
    from splitserve.autoscaler.sim import trace
    from splitserve.autoscaler.sim.experiment import Experiment
    from splitserve.common.config import ClusterSpec

    requests = trace.scale(trace_rows(case), rate_scale=case.rate_scale, duration_s=duration, seed=seed)
    spec = ClusterSpec()
    # the simulated cold start, and the law's coldStartSeconds measured to match (60 s: the rounds before flips)
    spec.autoscaling.cold_start_seconds = cold_start_s
    spec.autoscaling.role_flips = flips
    spec.autoscaling.mode = "slo"
    spec.autoscaling.gpu_budget = gpus
    for role in (spec.prefill, spec.decode):
        role.max_replicas = gpus
    exp = Experiment(requests, spec, ReplicaProfile.load(GPU_PROFILE), target=TARGET)
    return exp


def router_of(exp) -> dict[str, Any]:
    """What the simulated gateways do with a prompt (results from other settings are not comparable)."""
    s = settings_of(exp)
    return {"policy": s.routing, "disagg_threshold": s.disagg_threshold,
            "spill_prefill_tokens": s.spill_prefill_tokens, "spill_local_tokens": s.spill_local_tokens}


def settings_of(exp):
    from dataclasses import replace

    return replace(exp.settings, join_quantum_s=JOIN_QUANTUM_S)


def task_window(case: TraceCase, duration: float | None, gpus: int, k: int) -> dict[str, Any]:
    """The oracle's search for window k."""
    from splitserve.autoscaler.sim.oracle import cheapest_static, shifted

    exp = experiment(case, duration, gpus)
    start = k * exp.window_s
    chosen = [r for r in exp.requests if start <= r.arrival < start + exp.window_s]
    end = exp.requests[-1].arrival
    length = min(exp.window_s, max(end - start, 1e-3))
    settings = settings_of(exp)
    c = cheapest_static(shifted(chosen, start), settings, length, TARGET, exp.max_replicas, gpus)
    feasible = [r for r in c.result.requests if settings.feasible(r)]
    return {"k": k, "start": start, "length": length, "prefill": c.prefill, "decode": c.decode,
            "requests": len(chosen), "met": c.met, "target": c.target, "sims": c.sims, "feasible": len(feasible),
            "feasible_met": sum(r.meets(settings.ttft_s, settings.itl_s) for r in feasible)}


def with_floors(exp, law: str) -> str:
    """law+minPxD: an operator's minReplicas of P prefill and D decode, set on the experiment's spec; the law."""
    law, _, floors = law.partition("+min")
    if floors:
        exp.spec.prefill.min_replicas, exp.spec.decode.min_replicas = (int(x) for x in floors.split("x"))
    return law


def task_policy(case: TraceCase, duration: float | None, gpus: int, policy: str, initial: tuple[int, int],
                windows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    from splitserve.autoscaler.sim.oracle import best_static
    from splitserve.autoscaler.sim.report import summary
    from splitserve.autoscaler.sim.simulator import simulate

    exp = experiment(case, duration, gpus)
    t0 = time.perf_counter()
    if policy.startswith("static<="):  # the best static, searched down from the oracle's largest plans
        upper = tuple(int(x) for x in policy.split("=")[1].split("x"))
        choice = best_static(exp.requests, settings_of(exp), TARGET, exp.max_replicas, gpus, upper)
        res = choice.result
        out = summary(res) | {"static": [choice.prefill, choice.decode], "sims": choice.sims}
    else:
        law, _, start = policy.partition("@")  # law@PxD: start from P prefill + D decode replicas
        if start:
            initial = tuple(int(x) for x in start.split("x"))  # type: ignore[assignment]
        law = with_floors(exp, law)
        if law == "slo_warm2":
            exp.spec.autoscaling.warm_replicas = 2
        if law.startswith("late_oracle"):
            from splitserve.autoscaler.sim.laws import LateOracleLaw

            if not windows:
                raise ValueError(f"{policy} needs the oracle's windows")
            plans = [(w["prefill"], w["decode"]) for w in windows]
            span = len(plans) if law == "late_oracle_all" else int(law.removeprefix("late_oracle"))
            scaling = LateOracleLaw(plans, exp.window_s, span, interval_s=exp.spec.autoscaling.interval_seconds)
        else:
            scaling = exp.law(law.removesuffix("_warm2"))
        res = simulate(exp.requests, settings_of(exp), scaling, initial)
        out = summary(res) | {"policy": policy, "initial": list(initial)}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["timeline"] = [[round(pt.time), pt.prefill["ready"] + pt.prefill["starting"],
                        pt.decode["ready"] + pt.decode["starting"], pt.gpus] for pt in res.timeline[::4]]
    out["target_met"] = out["slo_attainment"] >= TARGET * out["feasible_fraction"] - 1e-9
    return out


def benchmark(names: list[str], duration: float | None, gpus: int, jobs: int, plot: bool, reuse: bool,
              only: list[str] | None = None) -> dict[str, Any]:
    all_out: dict[str, Any] = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for name in names:
            case = CASES[name]
            t0 = time.perf_counter()
            exp = experiment(case, duration, gpus)
            path = RESULTS / f"autoscaling_{name}.json"
            prev = json.loads(path.read_text()) if reuse and path.exists() else None
            router = router_of(exp)
            same = prev is not None and (prev["rate_scale"], prev["duration_s"], prev["gpu_budget"], prev["profile"],
                                         prev["requests"], prev.get("router")) == (case.rate_scale, duration, gpus,
                                                                                   exp.profile.name,
                                                                                   len(exp.requests), router)
            if same:  # the oracle and the best static do not depend on the laws: keep them
                windows = prev["oracle_windows"]
            else:
                n_windows = math.floor(exp.requests[-1].arrival / exp.window_s) + 1
                windows = sorted(pool.map(task_window, *zip(*[(case, duration, gpus, k) for k in range(n_windows)],
                                                            strict=True)), key=lambda w: w["k"])
                windows = [w for w in windows if w["requests"]]
            oracle_gpu_s = sum((w["prefill"] + w["decode"]) * w["length"] for w in windows)
            oracle_met = sum(w["met"] for w in windows) / max(1, sum(w["requests"] for w in windows))
            oracle_feasible = sum(w["feasible_met"] for w in windows) / max(1, sum(w["feasible"] for w in windows))
            initial = (max(1, windows[0]["prefill"]), max(1, windows[0]["decode"]))
            upper = f"static<={max(w['prefill'] for w in windows)}x{max(w['decode'] for w in windows)}"
            policies = only or list(POLICIES)
            tasks = ([] if same else [upper]) + policies  # the static search first: it is the longest
            runs = dict(zip(tasks, pool.map(task_policy, *zip(*[(case, duration, gpus, t, initial, windows)
                                                                 for t in tasks], strict=True)), strict=True))
            best = prev["policies"]["static"] if same else runs[upper]
            rows = {"oracle": {"policy": "oracle", "slo_attainment": round(oracle_met, 4),
                               "feasible_attainment": round(oracle_feasible, 4),
                               "gpu_seconds": round(oracle_gpu_s, 1), "max_gpus": max(w["prefill"] + w["decode"]
                                                                                      for w in windows)},
                    "static": best | {"policy": f"static {best['static'][0]}:{best['static'][1]}"}}
            if same and only:  # add these runs to the ones kept
                rows |= {k: v for k, v in prev["policies"].items() if k not in ("oracle", "static")}
            rows |= {p: runs[p] for p in policies}
            for r in rows.values():
                r["gpu_seconds_vs_oracle"] = round(r["gpu_seconds"] / oracle_gpu_s, 3)
            result = {"trace": case.file, "rate_scale": case.rate_scale, "duration_s": duration, "gpu_budget": gpus,
                      "requests": len(exp.requests), "slo": {"ttft_s": exp.spec.slo.ttft_seconds,
                                                             "itl_s": exp.spec.slo.itl_seconds},
                      "profile": exp.profile.name, "router": router,
                      "cold_start_s": exp.spec.autoscaling.cold_start_seconds,
                      "initial": list(initial), "oracle_windows": windows,
                      "policies": rows, "wall_s": round(time.perf_counter() - t0, 1), "machine": machine()}
            path.write_text(json.dumps(result, indent=1) + "\n")
            print_trace(name, result)
            if plot:
                plot_trace(name, result)
            all_out[name] = result
    return all_out


ROBUSTNESS = {  # variant: (seed, the simulated steps x this against the law's profile, cold start s)
    "base": (0, 1.0, None), "seed 1": (1, 1.0, None), "seed 2": (2, 1.0, None), "seed 3": (3, 1.0, None),
    "seed 4": (4, 1.0, None), "seed 5": (5, 1.0, None), "steps -20%": (0, 0.8, None), "steps +20%": (0, 1.2, None),
    "cold start 30 s": (0, 1.0, 30.0), "cold start 120 s": (0, 1.0, 120.0)}


def task_robust(case: TraceCase, duration: float | None, gpus: int, policy: str, variant: str,
                initial: tuple[int, int]) -> dict[str, Any]:
    """One law under one robustness variant: another seed (other copies' jitter), a profile wrong by 20% (the
    simulated cluster's steps scaled, the law keeps the committed profile) or another cold start (simulated and
    the law's coldStartSeconds alike: it is measured)."""
    from dataclasses import replace

    from splitserve.autoscaler.profile import StepCost
    from splitserve.autoscaler.sim.report import summary
    from splitserve.autoscaler.sim.simulator import simulate

    seed, k, load = ROBUSTNESS[variant]
    exp = experiment(case, duration, gpus, seed=seed, cold_start_s=load or 60.0)
    c = exp.profile.cost
    truth = replace(exp.profile, cost=StepCost(c.base_s * k, c.per_seq_s * k, c.per_token_s * k, c.knee_tokens,
                                               c.per_ctx_token_s * k, c.per_attn_pair_s * k))
    settings = replace(settings_of(exp), profile=truth)
    t0 = time.perf_counter()
    res = simulate(exp.requests, settings, exp.law(with_floors(exp, policy)), initial)
    return summary(res) | {"policy": policy, "variant": variant, "wall_s": round(time.perf_counter() - t0, 1)}


def trace_results(name: str, duration: float | None, use: str) -> dict[str, Any]:
    """results/autoscaling_<name>.json, which `use` (a reason, for the error) prices against; refused when it is
    for another --duration."""
    base = json.loads((RESULTS / f"autoscaling_{name}.json").read_text())
    if base["duration_s"] != duration:
        raise SystemExit(f"results/autoscaling_{name}.json is for duration {base['duration_s']}: run the benchmark "
                         f"with the same --duration first ({use})")
    return base


def robustness(names: list[str], duration: float | None, gpus: int, jobs: int, policies: list[str]) -> dict[str, Any]:
    """Each law on each trace under every ROBUSTNESS variant; GPU-seconds against the base oracle (the oracle is
    not re-searched per variant: it pays no cold start, and seeds and profile errors move it little) and against
    the same law's base run. -> results/autoscaling_robustness.{json,md}"""
    out: dict[str, Any] = {"duration_s": duration, "gpu_budget": gpus, "variants": {k: list(v) for k, v in
                                                                                    ROBUSTNESS.items()}, "traces": {}}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for name in names:
            case = CASES[name]
            base = trace_results(name, duration, "robustness reuses its oracle")
            oracle_s = base["policies"]["oracle"]["gpu_seconds"]
            initial = tuple(base["initial"])
            tasks = [(p, v) for p in policies for v in ROBUSTNESS]
            runs = list(pool.map(task_robust, *zip(*[(case, duration, gpus, p, v, initial) for p, v in tasks],
                                                   strict=True)))
            rows = []
            for r in runs:
                ref = next(x for x in runs if x["policy"] == r["policy"] and x["variant"] == "base")
                rows.append({k: r[k] for k in ("policy", "variant", "slo_attainment", "feasible_attainment",
                                               "gpu_seconds", "max_gpus", "failed", "scale_changes")}
                            | {"gpu_seconds_vs_oracle": round(r["gpu_seconds"] / oracle_s, 3),
                               "gpu_seconds_vs_base": round(r["gpu_seconds"] / ref["gpu_seconds"], 3),
                               "feasible_attainment_change": round(r["feasible_attainment"]
                                                                   - ref["feasible_attainment"], 4)})
            out["traces"][name] = {"trace": case.file, "rate_scale": case.rate_scale, "oracle_gpu_seconds": oracle_s,
                                   "runs": rows}
    lines = ["# Robustness of the simulator's verdict", "",
             "`benchmarks/autoscaling.py --robustness`: each law under five other seeds, a profile 20% off (the "
             "simulated steps x0.8 / x1.2, the law keeps the committed profile) and cold starts of 30 s and 120 s "
             "(simulated and configured). GPU-s against the base run's oracle and against the law's own base run.",
             ""]
    for name, t in out["traces"].items():
        lines += [f"## {name} ({t['trace']} x{t['rate_scale']:g})", "",
                  "| policy | variant | attainment | of feasible | change | GPU-s x oracle | x base | max GPUs | failed |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['policy']} | {r['variant']} | {r['slo_attainment']:.3f} | {r['feasible_attainment']:.3f} | "
                  f"{r['feasible_attainment_change']:+.3f} | {r['gpu_seconds_vs_oracle']:.2f} | "
                  f"{r['gpu_seconds_vs_base']:.2f} | {r['max_gpus']} | {r['failed']} |" for r in t["runs"]]
        lines.append("")
    summary_line = {name: {f"{r['policy']}/{r['variant']}": [r["feasible_attainment"], r["gpu_seconds_vs_oracle"]]
                           for r in t["runs"]} for name, t in out["traces"].items()}
    header = {k: v for k, v in out.items() if k != "traces"}
    runs = [{"trace": name, **r} for name, t in out["traces"].items() for r in t["runs"]]
    (RESULTS / "autoscaling_robustness.json").write_text(  # JSON lines: the setup, one line a run, the summary last
        "\n".join(json.dumps(x) for x in [header, *runs, {"summary": summary_line}]) + "\n")
    (RESULTS / "autoscaling_robustness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(summary_line))
    return out


REBALANCE_COLD_STARTS = (20.0, 150.0)  # s: the engines' cold starts on an H200 (native, vllm; the profile's)
# slo_warm2: warmReplicas 2 (an operator's margin); slo_hold6x4: bursts held (autoscaling.bursts hold) with 6 prefill
# and 4 decode warm replicas, Azure code's setting
REBALANCE_POLICIES = ("slo", "slo_warm2", "slo_hold6x4", "ray", "wva", "dynamo")
# the bursty trace's goal is the law's GPU-seconds at 95% of feasible requests, against the onset-blind reference's
# (--bound --rebalance): the law's frontier, its operator's margin (warmReplicas) raised until it crosses 95%
# and the law holding its level through bursts (autoscaling.bursts hold) with warm replicas per role, slo_holdPxD
FRONTIER_POLICIES = ("slo_warm3", "slo_warm4", "slo_warm6", "slo_warm8", "slo_hold8x4", "slo_hold10x6", "slo_hold11x7",
                     "slo_hold12x7", "slo_hold13x8")
BOUND_GOAL_FACTOR = 1.05  # the bursty trace's goal: within this x the reference's GPU-seconds at 95%
GOAL_COST = 1.15  # GPU-seconds x the oracle's the goal allows (Azure conversation, Mooncake, Azure code)


def task_rebalance(case: TraceCase, duration: float | None, gpus: int, policy: str, cold_start_s: float,
                   flips: bool, initial: tuple[int, int]) -> dict[str, Any]:
    """One law at one cold start (simulated and configured alike), with role flips or without: for the law, its
    own flips; for the anchors' laws, the actuator's (a role that grows while the other shrinks flips)."""
    from splitserve.autoscaler.sim.report import summary
    from splitserve.autoscaler.sim.simulator import simulate

    exp = experiment(case, duration, gpus, cold_start_s=cold_start_s, flips=flips)
    law, _, warm = policy.partition("_warm")  # slo_warmN: the law with N warm replicas per role
    exp.spec.autoscaling.warm_replicas = int(warm or 0)
    law, _, hold = law.partition("_hold")  # slo_holdPxD: bursts held, P and D warm replicas
    if hold:
        a = exp.spec.autoscaling
        a.bursts, (a.warm_prefill_replicas, a.warm_decode_replicas) = "hold", map(int, hold.split("x"))
    t0 = time.perf_counter()
    res = simulate(exp.requests, settings_of(exp), exp.law(law), initial)
    return summary(res) | {"policy": policy, "cold_start_s": cold_start_s, "flips": flips, "role_flips": res.flips,
                           "wall_s": round(time.perf_counter() - t0, 1),
                           "timeline": [[round(pt.time), pt.prefill["ready"] + pt.prefill["starting"]
                                         + pt.prefill["flipping"], pt.decode["ready"] + pt.decode["starting"]
                                         + pt.decode["flipping"], pt.gpus] for pt in res.timeline[::4]]}


def better(ours: dict[str, Any], theirs: dict[str, Any], cost_goal: float | None) -> bool:
    """Ours is better than an anchor's run: no fewer feasible requests served in time for no more GPU-seconds,
    or (where the trace has a cost goal) ours meets both halves of the goal and theirs does not."""
    def meets(r: dict[str, Any]) -> bool:
        return cost_goal is not None and r["feasible_attainment"] >= TARGET and r["gpu_seconds_vs_oracle"] <= cost_goal

    dominates = (ours["feasible_attainment"] >= theirs["feasible_attainment"]
                 and ours["gpu_seconds_vs_oracle"] <= theirs["gpu_seconds_vs_oracle"])
    return dominates or (meets(ours) and not meets(theirs))


def rebalance(names: list[str], duration: float | None, gpus: int, jobs: int, cold_starts: list[float],
              policies: list[str], flips: tuple[bool, ...] = (False, True), keep: bool = False,
              frontier: bool = False) -> dict[str, Any]:
    """Each trace at each cold start, with role flips and without, for the SLO law and the anchors' laws, beside
    the oracle and the best static of results/autoscaling_<trace>.json (neither pays a cold start nor flips).
    With `frontier`, the bursty trace also runs the law with larger margins (FRONTIER_POLICIES): its goal is where
    that frontier crosses 95% of feasible requests, against the bound's reference (`rebalance_goals`).
    -> results/autoscaling_rebalance_<trace>.json; a table per trace and a last JSON line with the goals."""
    out: dict[str, Any] = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for name in names:
            case = CASES[name]
            base = trace_results(name, duration, "the rebalance runs are priced against its oracle")
            oracle_s, initial = base["policies"]["oracle"]["gpu_seconds"], tuple(base["initial"])
            mine = policies + list(FRONTIER_POLICIES) if frontier and name == "bursty" else policies
            tasks = [(p, c, f) for c in cold_starts for f in flips for p in mine]
            t0 = time.perf_counter()
            runs = list(pool.map(task_rebalance, *zip(*[(case, duration, gpus, p, c, f, initial) for p, c, f in tasks],
                                                      strict=True)))
            path = RESULTS / f"autoscaling_rebalance_{name}.json"
            if keep and path.exists():  # the runs not repeated now stay
                again = {(p, c, f) for p, c, f in tasks}
                kept = [r for r in json.loads(path.read_text())["runs"]
                        if (r["policy"], r["cold_start_s"], r["flips"]) not in again]
                order = {(p, c, f): i for i, (c, f, p) in enumerate(
                    (c, f, p) for c in cold_starts for f in (False, True)
                    for p in REBALANCE_POLICIES + FRONTIER_POLICIES)}
                runs = sorted(kept + runs, key=lambda r: order.get((r["policy"], r["cold_start_s"], r["flips"]), 1e9))
            for r in runs:
                r["gpu_seconds_vs_oracle"] = round(r["gpu_seconds"] / oracle_s, 3)
            result = {"trace": case.file, "rate_scale": case.rate_scale, "duration_s": duration, "gpu_budget": gpus,
                      "requests": base["requests"], "profile": base["profile"], "router": base.get("router"),
                      "initial": list(initial), "cold_starts_s": cold_starts,
                      "oracle": base["policies"]["oracle"] | {"gpu_seconds_vs_oracle": 1.0},
                      "static": base["policies"]["static"], "runs": runs,
                      "wall_s": round(time.perf_counter() - t0, 1), "machine": machine()}
            path.write_text(json.dumps(result, indent=1) + "\n")
            print_rebalance(name, result)
            out[name] = result
    print(json.dumps({"rebalance": rebalance_goals(out)}))
    return out


def rebalance_goals(results: dict[str, Any]) -> dict[str, Any]:
    """Per trace, cold start and flips: the SLO law's feasible attainment and GPU-s x oracle, whether it meets the
    goal (a cost goal on the three shared traces; the bursty trace's is against the bound, --bound) and whether it
    is better than each anchor's run."""
    goals: dict[str, Any] = {}
    for name, r in results.items():
        cost_goal = None if name == "bursty" else GOAL_COST
        reference = bound_reference(name)
        for c in r["cold_starts_s"]:
            for f in (False, True):
                runs = {x["policy"]: x for x in r["runs"] if x["cold_start_s"] == c and x["flips"] == f}
                ours = runs.get("slo")
                if ours is None:
                    continue
                key = f"{name}@{c:g}s{'+flips' if f else ''}"
                goals[key] = {"feasible_attainment": ours["feasible_attainment"],
                              "gpu_seconds_vs_oracle": ours["gpu_seconds_vs_oracle"],
                              "better_than": anchors_beaten(ours, runs, cost_goal)}
                if cost_goal is not None:  # met by the law as it is, or by one of its settings (an operator's choice)
                    met_by = [p for p, x in runs.items() if p.startswith("slo") and x["feasible_attainment"] >= TARGET
                              and x["gpu_seconds_vs_oracle"] <= cost_goal]
                    goals[key] |= {"goal_met": bool(met_by), "met_by": met_by}
                    if met_by and met_by[0] != "slo":
                        goals[key]["better_than_" + met_by[0]] = anchors_beaten(runs[met_by[0]], runs, cost_goal)
                elif reference is not None:  # the law's margin raised until it crosses 95%, against the reference
                    law_at = frontier_at([x for p, x in runs.items() if p.startswith("slo")])
                    ref_at = reference.get(f"{c:g}")
                    goals[key] |= {"law_at_95": law_at, "reference_at_95": ref_at,
                                   "goal_met": law_at is not None and ref_at is not None
                                   and law_at <= BOUND_GOAL_FACTOR * ref_at}
    return goals


def anchors_beaten(law: dict[str, Any], runs: dict[str, dict[str, Any]], cost_goal: float | None) -> dict[str, bool]:
    """Per anchor (each run of `runs` that is not a setting of the SLO law): whether `law`'s run is better."""
    return {p: better(law, x, cost_goal) for p, x in runs.items() if not p.startswith("slo")}


def bound_reference(name: str) -> dict[str, float | None] | None:
    """Per cold start, the GPU-s x the oracle where the onset-blind reference (with flips available to it) crosses
    95% of feasible requests (results/autoscaling_bound_rebalance.json, --bound --rebalance); None if not run."""
    path = bound_rebalance_path(name)
    return json.loads(path.read_text())["best_at_95"] if name == "bursty" and path.exists() else None


def print_rebalance(name: str, r: dict[str, Any]) -> None:
    print(f"\n{name}: {r['requests']} requests ({r['trace']} x{r['rate_scale']:g}), start {r['initial']}; oracle "
          f"{r['oracle']['feasible_attainment']:.3f} of feasible, best static {r['static']['policy']} "
          f"{r['static']['feasible_attainment']:.3f} at {r['static']['gpu_seconds_vs_oracle']:.2f}x")
    print("| policy | cold start | flips | of feasible | GPU-s x oracle | peak GPUs | scale changes | flips done | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in r["runs"]:
        print(f"| {x['policy']} | {x['cold_start_s']:g} s | {'yes' if x['flips'] else 'no'} | "
              f"{x['feasible_attainment']:.3f} | {x['gpu_seconds_vs_oracle']:.2f} | {x['max_gpus']} | "
              f"{x['scale_changes']} | {x['role_flips']} | {x['failed']} |")


BOUND_WINDOW_S = 30.0  # s, the references' plan windows
BOUND_MARGINS = ((0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (2, 2), (2, 3), (4, 2), (4, 3), (4, 4), (6, 3), (6, 4),
                 (8, 4), (10, 5))  # standing (prefill, decode) replicas above the plans
# a real trace's clumps carry more than the generated bursts' first minute: its frontier runs further
BOUND_MARGINS_CLUMPS = BOUND_MARGINS + ((5, 3), (5, 4), (7, 2), (7, 3), (6, 6), (8, 6), (10, 6), (12, 6), (14, 7),
                                         (16, 8))
BOUND_SHORTER_STARTS = (30.0, 15.0)  # s, cold starts the onset-blind reference is also run with
BOUND_CLUMP_BIN_S = 5.0  # s: on a real trace, a clump of bins this long (`trace.clumps`) stands for a burst


BOUND_REBALANCE_MARGINS = BOUND_MARGINS + ((12, 6), (14, 7), (16, 8))  # 150-s starts need more standing capacity
# s: how far ahead a reference planning flips knows the split: a control interval, within which a law sees a burst
# and a flip lands (a worker's drain and flipSeconds)
BOUND_FLIP_LEAD_S = 15.0
BOUND_REBALANCE_WINDOW_S = 10.0  # s, --bound --rebalance's plan windows (see `bound_rebalance`)


def bound_path(name: str) -> Path:
    return RESULTS / ("autoscaling_bound.json" if name == "bursty" else f"autoscaling_bound_{name}.json")


@functools.lru_cache(maxsize=1)
def burst_onsets(case: TraceCase, duration: float | None, gpus: int):
    """The experiment (its requests only read) and, per request, the start of the burst it belongs to (None: the
    base stream): the generated trace's own bursts, or a real trace's clumps (runs of BOUND_CLUMP_BIN_S bins
    with over twice the mean bin's prompt tokens, `trace.clumps`)."""
    import bisect

    from splitserve.autoscaler.sim import bursty, trace

    exp = experiment(case, duration, gpus)
    if case.file == "generated:bursty":
        rows, found, tags = bursty.generate_tagged(bursty.BurstyConfig(max_prompt=case.max_input), seed=0)
        sources = trace.scale_sources(rows, rate_scale=case.rate_scale, duration_s=duration, seed=0)
        return exp, [None if tags[sources[r.rid]] < 0 else found[tags[sources[r.rid]]].start
                     for r in exp.requests]
    cs = trace.clumps(exp.requests, BOUND_CLUMP_BIN_S)
    starts = [c.start for c in cs]

    def onset(arrival: float) -> float | None:
        k = bisect.bisect_right(starts, arrival) - 1
        return cs[k].start if k >= 0 and arrival < cs[k].start + cs[k].length_s else None

    return exp, [onset(r.arrival) for r in exp.requests]


def burst_known(case: TraceCase, duration: float | None, gpus: int, k: int, lead_s: float | None,
                window_s: float = BOUND_WINDOW_S) -> list:
    """Window k's requests that a reference planning it knows of: all of them (`lead_s` None), or those of the
    base stream and of the bursts that began at least `lead_s` before the window ends (math.inf: the base
    stream's alone)."""
    exp, onsets = burst_onsets(case, duration, gpus)
    start, end = k * window_s, (k + 1) * window_s
    return [r for r, onset in zip(exp.requests, onsets, strict=True) if start <= r.arrival < end
            and (lead_s is None or onset is None or onset <= end - lead_s)]


def window_plans(pool: ProcessPoolExecutor, case: TraceCase, duration: float | None, gpus: int,
                 lead_s: float | None, window_s: float = BOUND_WINDOW_S) -> list[list[int]]:
    """A reference's plan for every window of the trace (`task_bound_window` for each, on the pool)."""
    exp, _ = burst_onsets(case, duration, gpus)
    n = math.floor(exp.requests[-1].arrival / window_s) + 1
    return list(pool.map(task_bound_window, *zip(*[(case, duration, gpus, k, lead_s, window_s) for k in range(n)],
                                                 strict=True)))


def task_bound_window(case: TraceCase, duration: float | None, gpus: int, k: int, lead_s: float | None,
                      window_s: float = BOUND_WINDOW_S) -> list[int]:
    """The cheapest static (P, D) for what the reference knows of window k (replayed alone, as the oracle's)."""
    from splitserve.autoscaler.sim.oracle import cheapest_static, shifted

    exp, _ = burst_onsets(case, duration, gpus)
    known = burst_known(case, duration, gpus, k, lead_s, window_s)
    if not known:
        return [0, 0]
    c = cheapest_static(shifted(known, k * window_s), settings_of(exp), window_s, TARGET, exp.max_replicas, gpus)
    return [c.prefill, c.decode]


def task_bound_run(case: TraceCase, duration: float | None, gpus: int, plans: list[list[int]],
                   margin: tuple[int, int], cold_start_s: float, flips: bool = False,
                   split_plans: list[list[int]] | None = None, window_s: float = BOUND_WINDOW_S) -> dict[str, Any]:
    from splitserve.autoscaler.sim.laws import ForesightLaw
    from splitserve.autoscaler.sim.report import summary
    from splitserve.autoscaler.sim.simulator import simulate

    exp = experiment(case, duration, gpus, cold_start_s=cold_start_s, flips=flips)
    law = ForesightLaw([(p, d) for p, d in plans], window_s, cold_start_s, margin,
                       interval_s=exp.spec.autoscaling.interval_seconds,
                       split_plans=None if split_plans is None else [(p, d) for p, d in split_plans],
                       split_lead_s=BOUND_FLIP_LEAD_S)
    res = simulate(exp.requests, settings_of(exp), law, law.at(0.0))
    return summary(res) | {"margin": list(margin), "role_flips": res.flips}


def bound(name: str, duration: float | None, gpus: int, jobs: int, reuse: bool) -> dict[str, Any]:
    """How far a trace's goal is from what any law reading only the past can reach. The references follow
    per-30-s-window plans (the cheapest static P:D for the window's requests replayed alone, as the oracle's)
    plus a standing margin of replicas, scaling up a cold start ahead of each window: `foresight` plans from
    every request (it knows the future: what a cold start costs when nothing is a surprise); `onset-blind@C`
    plans from the base stream's requests and those of the bursts that began at least a cold start C before the
    window ends, so a burst is a surprise for its first cold start and no longer (it then knows the burst's
    every request to its end). That is more than any causal law knows: a law deciding at t - C knows nothing of
    a burst that begins after, and where burst starts are a Poisson process the past gives no hint of the next
    one. `onset-blind@C, margin over the base stream` is the same but holds the larger of its plan and the base
    stream's plan plus the margin, not their sum. The bursts: the generated trace's own; a real trace's clumps
    (`burst_onsets`), whose starts are only measured to be near-Poisson. The cold start is simulated as C.
    -> results/autoscaling_bound[_<trace>].json"""
    case = CASES[name]
    base = trace_results(name, duration, "the bound is priced against its oracle")
    oracle_s = base["policies"]["oracle"]["gpu_seconds"]
    exp, onsets = burst_onsets(case, duration, gpus)
    lead = exp.spec.autoscaling.cold_start_seconds
    margins = BOUND_MARGINS if case.file == "generated:bursty" else BOUND_MARGINS_CLUMPS
    refs = {"foresight": (None, lead)} | {f"onset-blind@{c:g}": (c, c) for c in (lead, *BOUND_SHORTER_STARTS)}
    t0 = time.perf_counter()
    path = bound_path(name)
    prev = json.loads(path.read_text()) if reuse and path.exists() else None
    kept = prev["plans"] if prev and (prev["duration_s"], prev["window_s"]) == (duration, BOUND_WINDOW_S) else {}
    blind, over_base = f"onset-blind@{lead:g}", f"onset-blind@{lead:g}, margin over the base stream"
    known_of = {ref: known for ref, (known, _) in refs.items()} | {"base stream": math.inf}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        plans = {ref: kept.get(ref) or window_plans(pool, case, duration, gpus, known)
                 for ref, known in known_of.items()}
        # the onset-blind reference with its margin placed otherwise: only where the known load needs less than
        # the base stream's plan plus the margin (the larger of the two, not their sum); the same reference where
        # no burst is known before it ends (a real trace's clumps), so not run twice there
        if plans[blind] != plans["base stream"]:
            refs[over_base] = refs[blind]

        def followed(ref: str, m: tuple[int, int]) -> tuple[list[list[int]], tuple[int, int]]:
            if ref != over_base:
                return plans[ref], m
            return [[max(p, b + m[0]), max(d, c + m[1])] for (p, d), (b, c)
                    in zip(plans[blind], plans["base stream"], strict=True)], (0, 0)

        tasks = [(ref, m) for ref in refs for m in margins]
        runs = list(pool.map(task_bound_run, *zip(*[(case, duration, gpus, *followed(ref, m), refs[ref][1])
                                                    for ref, m in tasks], strict=True)))
    rows = []
    for (ref, m), r in zip(tasks, runs, strict=True):
        rows.append({"reference": ref, "cold_start_s": refs[ref][1], "margin": list(m),
                     "slo_attainment": r["slo_attainment"], "feasible_attainment": r["feasible_attainment"],
                     "gpu_seconds": r["gpu_seconds"], "gpu_seconds_vs_oracle": round(r["gpu_seconds"] / oracle_s, 3),
                     "max_gpus": r["max_gpus"], "scale_changes": r["scale_changes"]})
    in_bursts = sum(o is not None for o in onsets) / len(onsets)
    out = {"trace": case.file, "rate_scale": case.rate_scale, "duration_s": duration, "gpu_budget": gpus,
           "window_s": BOUND_WINDOW_S, "oracle_gpu_seconds": oracle_s, "bursts": len(set(onsets) - {None}),
           "share_in_bursts": round(in_bursts, 3), "plans": plans, "runs": rows,
           "wall_s": round(time.perf_counter() - t0, 1), "machine": machine()}
    if case.file != "generated:bursty":
        out["clump_bin_s"] = BOUND_CLUMP_BIN_S
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{name}: {out['bursts']} bursts carry {in_bursts:.0%} of the requests")
    print("| reference | cold start | margin P+D | attainment | of feasible | GPU-s × oracle | peak GPUs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['reference']} | {r['cold_start_s']:g} s | {r['margin'][0]}+{r['margin'][1]} | "
              f"{r['slo_attainment']:.3f} | {r['feasible_attainment']:.3f} | {r['gpu_seconds_vs_oracle']:.2f} | "
              f"{r['max_gpus']} |")
    print(json.dumps({"bound": {name: {f"{r['reference']}+{r['margin'][0]}x{r['margin'][1]}":
                                       [r["feasible_attainment"], r["gpu_seconds_vs_oracle"]] for r in rows}}}))
    return out


def frontier_at(rows: list[dict[str, Any]], target: float = TARGET) -> float | None:
    """GPU-s x the oracle where a reference's frontier (the cheapest attainment reached at each cost) crosses
    `target` of feasible requests, linear between the two margins around it; None if no margin reaches it."""
    pts = sorted((r["gpu_seconds_vs_oracle"], r["feasible_attainment"]) for r in rows)
    best, frontier = -1.0, []
    for cost, att in pts:  # the upper envelope: more attainment for more cost only
        if att > best:
            frontier.append((cost, att))
            best = att
    for (c0, a0), (c1, a1) in zip(frontier, frontier[1:], strict=False):
        if a0 < target <= a1:
            return round(c0 + (c1 - c0) * (target - a0) / (a1 - a0), 3)
    return frontier[0][0] if frontier and frontier[0][1] >= target else None


def bound_rebalance_path(name: str, window_s: float = BOUND_REBALANCE_WINDOW_S, causal: bool = False) -> Path:
    trace = "" if name == "bursty" else f"_{name}"
    window = "" if window_s == BOUND_REBALANCE_WINDOW_S else f"_w{window_s:g}"
    return RESULTS / f"autoscaling_bound_{'causal' if causal else 'rebalance'}{trace}{window}.json"


def bound_row(label: str, cold_start_s: float, margin: tuple[int, int], flips: bool, r: dict[str, Any],
              oracle_s: float) -> dict[str, Any]:
    """A bound reference's run (`task_bound_run`) as a results row."""
    return {"reference": label, "cold_start_s": cold_start_s, "margin": list(margin), "flips": flips,
            "slo_attainment": r["slo_attainment"], "feasible_attainment": r["feasible_attainment"],
            "gpu_seconds": r["gpu_seconds"], "gpu_seconds_vs_oracle": round(r["gpu_seconds"] / oracle_s, 3),
            "max_gpus": r["max_gpus"], "scale_changes": r["scale_changes"], "role_flips": r["role_flips"]}


def bound_rebalance(name: str, duration: float | None, gpus: int, jobs: int, cold_starts: list[float],
                    reuse: bool, window_s: float = BOUND_REBALANCE_WINDOW_S) -> dict[str, Any]:
    """The bound's onset-blind reference at each cold start C, three ways: as before (starts and stops); with
    the actuator's flips between its targets; and planning with flips (the total known C ahead, as before, the
    split BOUND_FLIP_LEAD_S ahead, reached by flips). Each over BOUND_REBALANCE_MARGINS; per C, where the best of
    the three crosses 95% of feasible requests (the goal's reference cost).

    Its plan windows are `window_s` long. A window's plan counts the bursts that began a cold start before the
    window ends, and its replicas are asked for a cold start before it begins: so the reference may provision
    for a burst up to one window before the burst begins. With 30-s windows and 20-s cold starts that is a third
    of the bursts seen before they begin; 10-s windows (the default) keep the reference's head start under 10 s,
    still at least what a law knows (a law deciding at t knows the bursts begun by t).
    -> results/autoscaling_bound_rebalance[_<trace>][_w<window>].json"""
    case = CASES[name]
    base = trace_results(name, duration, "the bound is priced against its oracle")
    oracle_s = base["policies"]["oracle"]["gpu_seconds"]
    path = bound_rebalance_path(name, window_s)
    kept: dict[str, Any] = {}
    for old in (bound_path(name), path):  # plans depend on what is known, not on the cold start simulated
        prev = json.loads(old.read_text()) if reuse and old.exists() else None
        if prev and (prev["duration_s"], prev["window_s"]) == (duration, window_s):
            kept |= prev["plans"]
    known = {f"onset-blind@{c:g}": c for c in (*cold_starts, BOUND_FLIP_LEAD_S)}
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        plans = {ref: kept.get(ref) or window_plans(pool, case, duration, gpus, lead, window_s)
                 for ref, lead in known.items()}
        split = plans[f"onset-blind@{BOUND_FLIP_LEAD_S:g}"]
        tasks = []
        for c in cold_starts:
            ref = f"onset-blind@{c:g}"
            for label, flips, sp in ((ref, False, None), (f"{ref}, flips", True, None),
                                     (f"{ref}, planned flips", True, split)):
                tasks += [(label, c, m, flips, sp) for m in BOUND_REBALANCE_MARGINS]
        runs = list(pool.map(task_bound_run, *zip(*[(case, duration, gpus, plans[f"onset-blind@{c:g}"], m, c, f, sp,
                                                     window_s) for _, c, m, f, sp in tasks], strict=True)))
    rows = [bound_row(label, c, m, f, r, oracle_s) for (label, c, m, f, _), r in zip(tasks, runs, strict=True)]
    crossing = {label: frontier_at([r for r in rows if r["reference"] == label]) for label in dict.fromkeys(
        r["reference"] for r in rows)}
    best = {f"{c:g}": min((v for k, v in crossing.items() if k.startswith(f"onset-blind@{c:g}") and v is not None),
                          default=None) for c in cold_starts}
    out = {"trace": case.file, "rate_scale": case.rate_scale, "duration_s": duration, "gpu_budget": gpus,
           "window_s": window_s, "flip_lead_s": BOUND_FLIP_LEAD_S, "oracle_gpu_seconds": oracle_s,
           "plans": plans, "runs": rows, "crossing_95": crossing, "best_at_95": best,
           "wall_s": round(time.perf_counter() - t0, 1), "machine": machine()}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print_bound_rows(rows)
    print(json.dumps({"bound_rebalance": {name: {"crossing_95": crossing, "best_at_95": best}}}))
    return out


def print_bound_rows(rows: list[dict[str, Any]]) -> None:
    """A bound reference's runs, a row per margin (--bound --rebalance, with or without --causal)."""
    print("| reference | margin P+D | of feasible | GPU-s × oracle | peak GPUs | flips |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['reference']} | {r['margin'][0]}+{r['margin'][1]} | {r['feasible_attainment']:.3f} | "
              f"{r['gpu_seconds_vs_oracle']:.2f} | {r['max_gpus']} | {r['role_flips']} |")


def bound_causal(name: str, duration: float | None, gpus: int, jobs: int, cold_starts: list[float],
                 window_s: float = BOUND_REBALANCE_WINDOW_S) -> dict[str, Any]:
    """The onset-blind reference without its head start: a window's plan counts only the bursts that began by the
    time its replicas are asked for (a cold start before the window begins), which is what a law deciding then
    could know of them; it still knows each such burst's every request to its end, and the base stream's. With
    the actuator's flips, over BOUND_REBALANCE_MARGINS; per cold start, where it crosses 95% of feasible
    requests. (The bound's reference, `bound_rebalance`, knows the bursts that began by the window's end.)
    -> results/autoscaling_bound_causal[_<trace>][_w<window>].json"""
    case = CASES[name]
    base = trace_results(name, duration, "the bound is priced against its oracle")
    oracle_s = base["policies"]["oracle"]["gpu_seconds"]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:  # known a window earlier than `end - c`
        plans = {f"causal@{c:g}": window_plans(pool, case, duration, gpus, c + window_s, window_s) for c in cold_starts}
        tasks = [(c, m) for c in cold_starts for m in BOUND_REBALANCE_MARGINS]
        runs = list(pool.map(task_bound_run, *zip(*[(case, duration, gpus, plans[f"causal@{c:g}"], m, c, True, None,
                                                     window_s) for c, m in tasks], strict=True)))
    rows = [bound_row(f"causal@{c:g}, flips", c, m, True, r, oracle_s) for (c, m), r in zip(tasks, runs, strict=True)]
    best = {f"{c:g}": frontier_at([r for r in rows if r["cold_start_s"] == c]) for c in cold_starts}
    out = {"trace": case.file, "rate_scale": case.rate_scale, "duration_s": duration, "gpu_budget": gpus,
           "window_s": window_s, "oracle_gpu_seconds": oracle_s, "plans": plans, "runs": rows, "best_at_95": best,
           "wall_s": round(time.perf_counter() - t0, 1), "machine": machine()}
    bound_rebalance_path(name, window_s, causal=True).write_text(json.dumps(out, indent=1) + "\n")
    print_bound_rows(rows)
    print(json.dumps({"bound_causal": {name: {"best_at_95": best}}}))
    return out


RATCHET_WINDOWS = (120.0, 300.0, 600.0)  # s, how often the ratchet reads attainment
RATCHET_STEPS = ((1, 1), (1, 0), (0, 1))  # (prefill, decode) replicas added after a window under the target
CLUMP_BINS = (5.0, 15.0)  # s


def task_ratchet(case: TraceCase, duration: float | None, gpus: int, initial: tuple[int, int], window_s: float,
                 step: tuple[int, int]) -> dict[str, Any]:
    """From the start pair, after each window whose attainment (all its requests) is under the target, add
    `step` replicas from the next window on; never scale down. It reads every window's exact attainment, which
    no law observes, and acts at the next window's start (its replicas load for the cold start)."""
    from splitserve.autoscaler.sim.laws import ForesightLaw
    from splitserve.autoscaler.sim.report import summary
    from splitserve.autoscaler.sim.simulator import fresh, simulate

    exp = experiment(case, duration, gpus)
    n = math.floor(exp.requests[-1].arrival / window_s) + 1
    plans, checked = [initial] * n, 0
    while True:
        res = simulate(fresh(exp.requests), settings_of(exp), ForesightLaw(plans, window_s, 0.0), initial)
        short = next((k for k in range(checked, n - 1)
                      if res.attainment(k * window_s, (k + 1) * window_s) < TARGET), None)
        if short is None:
            break
        p, d = plans[short + 1]
        plans = plans[:short + 1] + [(p + step[0], d + step[1])] * (n - short - 1)
        checked = short + 1
    return summary(res) | {"window_s": window_s, "step": list(step), "final": list(plans[-1]),
                           "raised_at_s": [k * window_s for k in range(1, n) if plans[k] != plans[k - 1]]}


MISS_WINDOW_S = 300.0  # s, the windows the ratchet's report counts misses over (the oracle's)


def task_held(case: TraceCase, duration: float | None, gpus: int, pair: tuple[int, int] | None,
              initial: tuple[int, int]) -> dict[str, Any]:
    """A pair held for the whole trace (None: the SLO law from `initial`), with its misses per MISS_WINDOW_S."""
    from splitserve.autoscaler.sim.laws import StaticLaw
    from splitserve.autoscaler.sim.report import summary
    from splitserve.autoscaler.sim.simulator import fresh, simulate

    exp = experiment(case, duration, gpus)
    s = settings_of(exp)
    res = (simulate(fresh(exp.requests), s, StaticLaw(*pair), pair) if pair
           else simulate(fresh(exp.requests), s, exp.law("slo"), initial))
    misses = [0] * (math.floor(exp.requests[-1].arrival / MISS_WINDOW_S) + 1)
    for r in res.requests:
        if not r.meets(s.ttft_s, s.itl_s):
            misses[math.floor(r.arrival / MISS_WINDOW_S)] += 1
    return summary(res) | {"misses_per_window": misses}


def clump_stats(requests: list) -> dict[str, Any]:
    """The trace's clumps (bins with over twice the mean bin's prompt tokens) at each of CLUMP_BINS: how many,
    how long, what share of the requests, and how regular their starts are (coefficient of variation of the
    gaps: 1 for a Poisson process)."""
    import statistics

    from splitserve.autoscaler.sim.trace import clumps, per_bin

    out: dict[str, Any] = {}
    for b in CLUMP_BINS:
        cs = clumps(requests, b)
        gaps = [y.start - x.start for x, y in zip(cs, cs[1:], strict=False)]
        out[f"{b:g}s"] = {"clumps": len(cs), "length_mean_s": round(statistics.fmean(c.length_s for c in cs), 1),
                          "length_max_s": max(c.length_s for c in cs),
                          "requests_share": round(sum(c.requests for c in cs) / len(requests), 3),
                          "start_gap_mean_s": round(statistics.fmean(gaps), 1),
                          "start_gap_cv": round(statistics.pstdev(gaps) / statistics.fmean(gaps), 2)}
    load, _ = per_bin(requests, CLUMP_BINS[-1])
    lags = range(1, round(600 / CLUMP_BINS[-1]) + 1)
    out["load_autocorrelation"] = {f"{k * CLUMP_BINS[-1]:g}s": round(statistics.correlation(load[:-k], load[k:]), 2)
                                   for k in lags}
    return out


def _ratchet_row(r: dict[str, Any], oracle_s: float, **extra: Any) -> dict[str, Any]:
    keep = ("slo_attainment", "feasible_attainment", "gpu_seconds", "max_gpus")
    return extra | {k: r[k] for k in keep} | {"gpu_seconds_vs_oracle": round(r["gpu_seconds"] / oracle_s, 3)}


def ratchet(names: list[str], duration: float | None, gpus: int, jobs: int) -> dict[str, Any]:
    """What a law could learn of a clumpy trace's standing capacity: the trace's clumps, the start pair held
    throughout, the best static and the SLO law (their misses per window beside the hour's allowance), and
    ratchets that raise the start pair after every window short of the target (reading attainment no law
    observes) and never lower it. -> results/autoscaling_ratchet.json"""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"duration_s": duration, "gpu_budget": gpus, "traces": {}}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for name in names:
            case = CASES[name]
            base = trace_results(name, duration, "the ratchet is priced against its oracle")
            oracle_s, initial = base["policies"]["oracle"]["gpu_seconds"], tuple(base["initial"])
            tasks = [(w, s) for w in RATCHET_WINDOWS for s in RATCHET_STEPS]
            static = tuple(base["policies"]["static"]["static"])
            held = {key: pool.submit(task_held, case, duration, gpus, pair, initial)
                    for key, pair in (("hold_start", initial), ("best_static", static), ("slo", None))}
            runs = list(pool.map(task_ratchet, *zip(*[(case, duration, gpus, initial, w, s) for w, s in tasks],
                                                    strict=True)))

            requests = experiment(case, duration, gpus).requests
            out["traces"][name] = {
                "initial": list(initial), "oracle_gpu_seconds": oracle_s, "clumps": clump_stats(requests),
                "allowed_misses": math.floor((1 - TARGET) * len(requests)),
                "misses_window_s": MISS_WINDOW_S,
                **{key: _ratchet_row(f.result(), oracle_s, misses_per_window=f.result()["misses_per_window"])
                   for key, f in held.items()},
                "best_static_pair": list(static),
                "ratchets": [_ratchet_row(r, oracle_s, window_s=r["window_s"], step=r["step"], final=r["final"],
                                          raised_at_s=r["raised_at_s"]) for r in runs]}
    out |= {"wall_s": round(time.perf_counter() - t0, 1), "machine": machine()}
    (RESULTS / "autoscaling_ratchet.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, r in out["traces"].items():
        print(f"{name}: clumps {json.dumps(r['clumps'])}")
        print("| policy | attainment | of feasible | GPU-s × oracle | final P:D, or misses per window |")
        print("|---|---|---|---|---|")
        for label, key in ((f"hold the start {r['initial'][0]}:{r['initial'][1]}", "hold_start"),
                           ("best static " + ":".join(map(str, r["best_static_pair"])), "best_static"), ("slo", "slo")):
            h = r[key]
            print(f"| {label} | {h['slo_attainment']:.3f} | {h['feasible_attainment']:.3f} | "
                  f"{h['gpu_seconds_vs_oracle']:.2f} | misses per {r['misses_window_s']:g} s: {h['misses_per_window']} |")
        for x in r["ratchets"]:
            print(f"| ratchet {x['window_s']:g} s +{x['step'][0]}:+{x['step'][1]} | {x['slo_attainment']:.3f} | "
                  f"{x['feasible_attainment']:.3f} | {x['gpu_seconds_vs_oracle']:.2f} | {x['final'][0]}:{x['final'][1]} |")
    print(json.dumps({"ratchet": {name: {f"{x['window_s']:g}s+{x['step'][0]}x{x['step'][1]}":
                                         [x["feasible_attainment"], x["gpu_seconds_vs_oracle"]] for x in r["ratchets"]}
                                  | {key: [r[key]["feasible_attainment"], r[key]["gpu_seconds_vs_oracle"]]
                                     for key in ("hold_start", "best_static", "slo")}
                                  for name, r in out["traces"].items()}}))
    return out


def print_trace(name: str, r: dict[str, Any]) -> None:
    print(f"\n{name}: {r['requests']} requests ({r['trace']} x{r['rate_scale']:g}), budget {r['gpu_budget']} GPUs, "
          f"start {r['initial']}, oracle peak {r['policies']['oracle']['max_gpus']} GPUs")
    print(f"{'policy':<14}{'attain':>8}{'feasible':>10}{'GPU-s':>10}{'vs oracle':>11}{'max GPUs':>10}{'failed':>8}")
    for p in r["policies"].values():
        print(f"{p['policy']:<14}{p['slo_attainment']:>8.3f}{p.get('feasible_attainment', float('nan')):>10.3f}"
              f"{p['gpu_seconds']:>10.0f}{p['gpu_seconds_vs_oracle']:>10.2f}x{p['max_gpus']:>10}{p.get('failed', 0):>8}")


def plot_trace(name: str, r: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (pip install -e '.[plot]')", file=sys.stderr)
        return
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for pol in [p for p in POLICIES if p in r["policies"]]:
        tl = r["policies"][pol]["timeline"]
        t = [x[0] / 60 for x in tl]
        axes[0].step(t, [x[1] for x in tl], where="post", label=pol)
        axes[1].step(t, [x[2] for x in tl], where="post", label=pol)
        axes[2].step(t, [x[3] for x in tl], where="post", label=pol)
    ws = r["oracle_windows"]
    t = [w["start"] / 60 for w in ws] + [(ws[-1]["start"] + ws[-1]["length"]) / 60]
    for ax, key in ((axes[0], "prefill"), (axes[1], "decode")):
        v = [w[key] for w in ws]
        ax.step(t, v + v[-1:], where="post", color="black", linestyle="--", label="oracle")
    v = [w["prefill"] + w["decode"] for w in ws]
    axes[2].step(t, v + v[-1:], where="post", color="black", linestyle="--", label="oracle")
    for ax, label in zip(axes, ("prefill replicas", "decode replicas", "GPUs held"), strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, ncol=5)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(f"{name} x{r['rate_scale']:g}: replicas over time")
    fig.tight_layout()
    fig.savefig(RESULTS / f"autoscaling_{name}.png", dpi=90)
    plt.close(fig)


def machine() -> dict[str, Any]:
    import platform

    return {"host": platform.node(), "cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]}


# -- the GPU profile --------------------------------------------------------------------------------------
def measure_gpu() -> dict[str, Any]:
    """Step times of our engine on this GPU, each step's contents known (run on the device machine)."""

    import gpu_engine as ge
    import torch

    from splitserve.engine import SamplingParams

    dev = torch.cuda.get_device_name(0)
    t0 = time.perf_counter()
    eng = ge.engine_for(ge.model_dir(ge.LLAMA8B), 40960, 2048, 128, "96GiB")  # the serving token budget
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    points: list[dict[str, Any]] = []
    for b, ctx in ((1, 1024), (1, 16384), (8, 4096), (32, 4096), (32, 16384), (64, 8192), (128, 1024), (128, 4096)):
        step = ge.decode_steps(eng, b, ctx, steps=10)  # 10 timed steps after the prompts and 3 warm-ups
        points.append({"kind": "decode", "num_seqs": b, "num_tokens": b, "ctx_tokens": b * (ctx + 9),
                       "attn_pairs": 0.0, "seconds": step})
        print(f"decode batch {b:4d} context {ctx:6d}: {step * 1e3:7.2f} ms", flush=True)
    g = torch.Generator().manual_seed(0)
    for n, seqs in ((512, 4), (2048, 1), (8192, 1), (32768, 1)):  # chunked prefill: one point per step
        for i in range(seqs):
            eng.add_request(f"p{n}-{i}", torch.randint(0, 128256, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=1, temperature=0))
        while eng.scheduler.waiting or eng.scheduler.running:
            before = {r.request_id: r.num_computed_tokens for r in eng.scheduler.running}
            waiting = {r.request_id: 0 for r in eng.scheduler.waiting}
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            done = {**waiting, **before}
            chunks = [(min(2048, n - past), past) for rid, past in done.items() if past < n][:max(1, 2048 // n)]
            if not chunks:
                continue
            tokens = sum(c for c, _ in chunks)
            points.append({"kind": "prefill", "num_seqs": len(chunks), "num_tokens": tokens, "ctx_tokens": 0,
                           "attn_pairs": sum(c * (p + (c + 1) / 2) for c, p in chunks), "seconds": dt})
            print(f"prefill step {tokens:5d} tokens after {chunks[0][1]:6d}: {dt * 1e3:7.2f} ms", flush=True)
    out = {"device": dev, "engine_build_s": round(build_s, 2), "points": points,
           "settings": {"max_num_batched_tokens": 2048, "max_num_seqs": 128, "kv_cache_memory": "96GiB",
                        "model": "llama-3.1-8b shape, dummy bf16 weights"}}
    path = out_path(GPU_STEPS.name)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return {"device": dev, "points": len(points), "engine_build_s": out["engine_build_s"], "file": str(path)}


def fit_gpu() -> dict[str, Any]:
    from dataclasses import replace

    from splitserve.autoscaler.sim.calibrate import fit_gpu_profile, kv_case, measured_prefill_steps

    gpu = json.loads((RESULTS / "gpu_engine_nvidia_h200.json").read_text())
    steps = measured_prefill_steps(GPU_STEPS) if GPU_STEPS.exists() else []
    prof = fit_gpu_profile(gpu, kv_case(RESULTS / "kv_transfer_nixl_cuda_2xh200.txt", "llama8b_3k"),
                           prefill_steps=steps, cold_start_seconds=H200_COLD_STARTS)
    prof = replace(prof, source=prof.source | {"cold_start_note": H200_COLD_START_NOTE})
    prof.save(GPU_PROFILE)
    worst = max(abs(e["error"]) for e in prof.source["errors"])
    print(f"{prof.name}: {prof.cost}\nworst fitted step error {worst:.1%}; wrote {GPU_PROFILE}")
    return {"profile": str(GPU_PROFILE), "max_abs_error": round(worst, 4)}


# -- the simulator against a real run on this CPU ------------------------------------------------------------
VALIDATION = RESULTS / "sim_calibration_validation_cpu2.json"
LATENCY_KEYS = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s")


def validation_cases(poisson_n: int, trace_n: int, rate: float) -> list[tuple[str, list]]:
    """The requests both the real run and the simulation see (splitserve bench's own generators, fixed seeds)."""
    from splitserve import bench

    vocab = (1000, 30000)
    return [("poisson", bench.poisson_jobs(poisson_n, rate, 384, 32, vocab, 1)),
            ("mooncake_slice", bench.load_trace(str(TRACES / "mooncake_conversation.jsonl"), trace_n, 0.5, 512, 32,
                                                vocab, 0))]


def measure_local(port: int, cases: list[tuple[str, list]], threshold: int) -> dict[str, Any]:
    """`splitserve up` (1 prefill + 1 decode worker) under `splitserve bench` (in-process: per-request latencies)."""
    import asyncio

    from splitserve import bench

    flags = ["--prefill", "1", "--decode", "1", "--disagg-threshold", str(threshold)]
    out: dict[str, Any] = {"loadavg_before": [round(x, 2) for x in os.getloadavg()],
                           "command": " ".join(["splitserve.cli", "up", "--port", str(port), *flags]), "measured": {}}
    cluster = Cluster(*flags, port=port, stop_s=30.0)
    try:
        out["up_ready_s"] = round(cluster.ready_s, 1)
        url = cluster.url
        for name, jobs in cases:
            results, elapsed = asyncio.run(bench.run(url, "smollm2", jobs, 900.0, False))
            m = _latencies([(r.ttft, r.itls) for r in results if r.ok])
            out["measured"][name] = m | {"failed": sum(not r.ok for r in results), "duration_s": round(elapsed, 1)}
    finally:
        cluster.stop()
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return out


def validate(port: int, poisson_n: int, trace_n: int, rate: float, resimulate: bool) -> dict[str, Any]:
    """Measure a real local run (or, with `resimulate`, reuse the last measurement), then simulate the same
    requests three ways: with the CPU profile as calibrated (engine steps measured alone); with its decode
    steps scaled by a factor fitted on the Poisson run's ITL p50; and with, besides, its prefill workers'
    steps scaled by a factor fitted on the Poisson run's TTFT p50 (in serving, the processes, the gateway and
    the load generator share the machine's cores; prefill also streams its KV layer by layer). The trace slice
    is held out of both fits."""
    from dataclasses import replace

    from splitserve.autoscaler.profile import ReplicaProfile, StepCost
    from splitserve.autoscaler.sim import trace as simtrace
    from splitserve.autoscaler.sim.laws import StaticLaw
    from splitserve.autoscaler.sim.simulator import SimSettings, simulate

    threshold = 128
    cases = validation_cases(poisson_n, trace_n, rate)
    if resimulate:
        out = json.loads(VALIDATION.read_text())
        if (out["poisson_rate"], out["poisson_requests"], out["trace_requests"]) != (rate, poisson_n, trace_n):
            raise SystemExit("--resimulate: the saved measurement used other --poisson-rate/--*-requests")
    else:
        out = measure_local(port, cases, threshold) | {"poisson_rate": rate, "poisson_requests": poisson_n,
                                                       "trace_requests": trace_n, "machine": machine()}
    measured = out["measured"]
    profile = ReplicaProfile.load(CPU_PROFILE)
    if profile.cold_start("native") != out["up_ready_s"]:  # the measured start-to-ready time of `splitserve up`
        profile = replace(profile, cold_start_seconds=profile.cold_start_seconds | {"native": out["up_ready_s"]},
                          source=profile.source | {"cold_start_note": "native: splitserve up start to ready "
                                                   "(gateway + 1 prefill + 1 decode), from --validate"})
        profile.save(CPU_PROFILE)

    def scaled(prof: ReplicaProfile, k: float) -> ReplicaProfile:
        c = prof.cost
        return replace(prof, cost=StepCost(c.base_s * k, c.per_seq_s * k, c.per_token_s * k, c.knee_tokens,
                                           c.per_ctx_token_s * k, c.per_attn_pair_s * k))

    def run_sim(decode_k: float, prefill_k: float, jobs) -> dict[str, float]:
        reqs = simtrace.from_token_jobs([(j.arrival, j.prompt, j.max_tokens) for j in jobs])
        settings = SimSettings(scaled(profile, decode_k), prefill_profile=scaled(profile, prefill_k), ttft_s=3.0,
                               itl_s=0.5, disagg_threshold=threshold)
        return _sim_latencies(simulate(reqs, settings, StaticLaw(1, 1), (1, 1)))

    poisson_jobs = cases[0][1]
    decode_k = measured["poisson"]["itl_p50_s"] / run_sim(1.0, 1.0, poisson_jobs)["itl_p50_s"]
    lo, hi = 0.5, 4.0  # the prefill factor: bisect on the Poisson run's TTFT p50 (it grows with the factor)
    for _ in range(30):
        mid = (lo + hi) / 2
        if run_sim(decode_k, mid, poisson_jobs)["ttft_p50_s"] < measured["poisson"]["ttft_p50_s"]:
            lo = mid
        else:
            hi = mid
    prefill_k = (lo + hi) / 2
    out["factors"] = {"decode": round(decode_k, 3), "prefill": round(prefill_k, 3)}
    variants = {"raw_profile": (1.0, 1.0), "decode_fitted": (decode_k, 1.0), "both_fitted": (decode_k, prefill_k)}
    out["cases"] = []
    for name, jobs in cases:
        m = measured[name]
        case: dict[str, Any] = {"name": name, "requests": len(jobs), "failed": m["failed"], "duration_s": m["duration_s"]}
        for variant, (dk, pk) in variants.items():
            sim = run_sim(dk, pk, jobs)
            case[variant] = {k: {"measured": round(m[k], 4), "simulated": round(sim[k], 4),
                                 "error": round(sim[k] / m[k] - 1, 4)} for k in LATENCY_KEYS}
        out["cases"].append(case)
        for variant in variants:
            v = case[variant]
            print(f"{name:15s} {variant:14s} " + ", ".join(
                f"{k} {v[k]['measured']:.3f} vs {v[k]['simulated']:.3f} ({v[k]['error']:+.0%})" for k in LATENCY_KEYS))
    held_out = next(c for c in out["cases"] if c["name"] == "mooncake_slice")
    out["held_out_max_abs_error"] = {v: max(abs(held_out[v][k]["error"]) for k in LATENCY_KEYS) for v in variants}
    VALIDATION.write_text(json.dumps(out, indent=1) + "\n")
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))] if s else float("nan")


def _latencies(per_request: list[tuple[float, list[float]]]) -> dict[str, float]:
    ttft = [t for t, _ in per_request]
    itl = [x for _, xs in per_request for x in xs]
    return {"ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9), "itl_p50_s": _pct(itl, 0.5),
            "itl_p90_s": _pct(itl, 0.9)}


def _sim_latencies(res) -> dict[str, float]:
    from splitserve.autoscaler.sim.metrics import weighted_percentiles

    ttft = [r.ttft for r in res.requests]
    itl = weighted_percentiles(res.itl_samples)
    return {"ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9), "itl_p50_s": itl.p50 or float("nan"),
            "itl_p90_s": itl.p90 or float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure-gpu", action="store_true")
    ap.add_argument("--fit-gpu", action="store_true")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--poisson-requests", type=int, default=16)
    ap.add_argument("--trace-requests", type=int, default=16)
    ap.add_argument("--poisson-rate", type=float, default=0.1, help="--validate: requests/s (below the CPU's capacity)")
    ap.add_argument("--resimulate", action="store_true", help="--validate: reuse the last measurement")
    ap.add_argument("--traces", default=",".join(CASES), help="which: " + ", ".join(CASES))
    ap.add_argument("--duration", type=float, default=None, help="trace seconds to replay (default: all)")
    ap.add_argument("--rate-scale", type=float, default=None, help="override every trace's rate scale")
    ap.add_argument("--gpus", type=int, default=64, help="GPU budget")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--only", default="", help="run just these policies (law, law@PxD: another start, "
                    "law+minPxD: with minReplicas P prefill and D decode), "
                    "added to the results file's; 'cold' = " + ",".join(COLD))
    ap.add_argument("--bound", action="store_true", help="the bursty trace (or each --traces trace) against "
                    "references that know its future but a burst's first cold start -> "
                    "results/autoscaling_bound[_<trace>].json")
    ap.add_argument("--ratchet", action="store_true", help="each --traces trace's clumps, its start pair held, "
                    "and ratchets that raise it after every window short of 95%% -> results/autoscaling_ratchet.json")
    ap.add_argument("--robustness", action="store_true",
                    help="each --only law (default slo) under five other seeds, +-20%% profile error and 30/120 s cold "
                    "starts -> results/autoscaling_robustness.{md,json} (needs the traces' results files)")
    ap.add_argument("--rebalance", action="store_true",
                    help="each --traces trace at each --cold-starts, with role flips and without, for the SLO law "
                    "and the anchors' laws (or --only) -> results/autoscaling_rebalance_<trace>.json")
    ap.add_argument("--flips", choices=("both", "yes", "no"), default="both",
                    help="--rebalance: run with role flips, without, or both")
    ap.add_argument("--cold-starts", default=",".join(f"{c:g}" for c in REBALANCE_COLD_STARTS),
                    help="--rebalance, --bound: cold starts (s) to run, comma-separated")
    ap.add_argument("--bound-window", type=float, default=BOUND_REBALANCE_WINDOW_S,
                    help="--bound --rebalance: the references' plan windows, s")
    ap.add_argument("--causal", action="store_true",
                    help="--bound --rebalance: the reference without its head start over a law "
                    "-> results/autoscaling_bound_causal[_<trace>][_w<window>].json")
    ap.add_argument("--reuse-baselines", action="store_true",
                    help="keep the oracle and best static of results/autoscaling_<trace>.json when its setup matches")
    args = ap.parse_args()
    if args.measure_gpu:
        print(json.dumps(measure_gpu()))
        return
    if args.fit_gpu:
        print(json.dumps(fit_gpu()))
        return
    if args.calibrate:
        res = subprocess.run([sys.executable, "-m", "splitserve.cli", "simulate", "--calibrate", "--out",
                              str(CPU_PROFILE)], capture_output=True, text=True)
        sys.stderr.write(res.stderr)
        if res.returncode:
            sys.exit(res.returncode)
        print(res.stdout.strip().splitlines()[-1])
        return
    if args.validate:
        out = validate(args.port, args.poisson_requests, args.trace_requests, args.poisson_rate, args.resimulate)
        print(json.dumps({k: out[k] for k in ("factors", "held_out_max_abs_error", "loadavg_before", "loadavg_after")}))
        return
    names = [n.strip() for n in args.traces.split(",") if n.strip()]
    if args.rate_scale is not None:
        for n in names:
            CASES[n] = TraceCase(CASES[n].name, CASES[n].file, args.rate_scale, CASES[n].max_input)
    only = list(COLD) if args.only == "cold" else [p for p in args.only.split(",") if p] or None
    cold_starts = [float(c) for c in args.cold_starts.split(",") if c.strip()]
    if args.bound:
        for name in names if args.traces != ap.get_default("traces") else ["bursty"]:
            if args.rebalance and args.causal:
                bound_causal(name, args.duration, args.gpus, args.jobs, cold_starts, args.bound_window)
            elif args.rebalance:
                bound_rebalance(name, args.duration, args.gpus, args.jobs, cold_starts, args.reuse_baselines,
                                args.bound_window)
            else:
                bound(name, args.duration, args.gpus, args.jobs, args.reuse_baselines)
        return
    if args.ratchet:
        ratchet(names, args.duration, args.gpus, args.jobs)
        return
    if args.rebalance:
        flips = {"both": (False, True), "yes": (True,), "no": (False,)}[args.flips]
        if (only or flips != (False, True)) and not args.reuse_baselines:
            ap.error("--rebalance with --only or --flips needs --reuse-baselines (it replaces those runs in the file)")
        rebalance(names, args.duration, args.gpus, args.jobs, cold_starts, only or list(REBALANCE_POLICIES), flips,
                  keep=args.reuse_baselines, frontier=only is None)
        return
    if args.robustness:
        robustness(names, args.duration, args.gpus, args.jobs, only or ["slo"])
        return
    if only and not args.reuse_baselines:
        ap.error("--only needs --reuse-baselines (it adds runs to a results file)")
    results = benchmark(names, args.duration, args.gpus, args.jobs, args.plot, args.reuse_baselines, only)
    last = {name: {p: {"slo_attainment": v["slo_attainment"], "feasible_attainment": v.get("feasible_attainment"),
                       "gpu_seconds_vs_oracle": v["gpu_seconds_vs_oracle"], "max_gpus": v["max_gpus"]}
                   for p, v in r["policies"].items()} for name, r in results.items()}
    goals = {name: {"attainment_ge_95": r["policies"]["slo"]["slo_attainment"] >= TARGET,
                    "feasible_attainment_ge_95": r["policies"]["slo"]["feasible_attainment"] >= TARGET,
                    "gpu_le_1_15x_oracle": r["policies"]["slo"]["gpu_seconds_vs_oracle"] <= 1.15}
             for name, r in results.items()}
    print(json.dumps({"traces": last, "goals": goals}))


if __name__ == "__main__":
    main()
