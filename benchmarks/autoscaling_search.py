"""A random search over the SLO law's parameters on issue 40's eight runs (four traces, cold starts of 20 s and
150 s, role flips on; seed 0): does any setting of the law meet more of the goals than its defaults?

Config 0 is the law's defaults; config i > 0 draws every parameter in SPACE at once from `random.Random(i)`, so a
config's number names the same setting on every machine. Each run is one line of
results/autoscaling_search.jsonl (the first line lists the configs), written as it finishes, so a run cut short
keeps what it finished. `--report` prints the table and the last JSON line from that file without running.

  python benchmarks/autoscaling_search.py --configs 110 --jobs 32      # 880 runs
  python benchmarks/autoscaling_search.py --report

The committed results are from the law before its smooth regime (`--no-smooth-regime`, issue 40's sixth pass):
the search is what found the regime (docs/autoscaling.md).

A config counts the goals it meets on the three shared traces (>= 95% of feasible requests within SLO at <= 1.15x
the oracle's GPU-seconds: six runs). The bursty trace's goal is a frontier against a reference
(`autoscaling.py --bound --rebalance`), not a single run, so its two runs are shown and not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import autoscaling as A
from harness import RESULTS

OUT = RESULTS / "autoscaling_search.jsonl"
RUNS = [(t, c) for t in ("azure_code", "bursty", "mooncake", "azure_conv") for c in (20.0, 150.0)]
SHARED = ("azure_conv", "azure_code", "mooncake")
# the law's parameters the search draws (LawConfig's names); the utilisation band moves with its target
SPACE: dict[str, list[Any]] = {
    "scale_down_cooldown_s": [150.0, 200.0, 300.0, 450.0, 600.0], "scale_up_cooldown_s": [15.0, 30.0, 60.0],
    "trend_window_s": [150.0, 300.0, 600.0], "max_forecast_growth": [0.05, 0.1, 0.15, 0.25],
    "smoothing_s": [30.0, 60.0, 120.0], "burst_queue_fraction": [0.25, 0.5, 1.0], "min_slo_factor": [0.5, 0.7, 0.85],
    "max_utilization": [0.9, 0.95, 1.0], "max_hold_factor": [2.0, 4.0, 6.0], "smooth_cv": [0.4, 0.6, 0.8],
    "smooth_prefill_hold_s": [120.0, 180.0, 300.0], "correction_gain": [0.1, 0.2, 0.4]}


def config(i: int) -> dict[str, Any]:
    """The overrides of config i (0: none, the law's defaults)."""
    if i == 0:
        return {}
    r = random.Random(i)
    t = round(r.uniform(0.7, 0.9), 3)
    out: dict[str, Any] = {"target_utilization": t, "high_utilization": round(min(1.0, t + 0.1), 3),
                           "low_utilization": round(t - 0.2, 3)}
    for name, choices in SPACE.items():
        out[name] = r.choice(choices)
    return out


def task(i: int, trace: str, cold_start_s: float, seed: int, smooth_regime: bool) -> dict[str, Any]:
    from splitserve.autoscaler.sim.report import summary
    from splitserve.autoscaler.sim.simulator import simulate

    base = A.trace_results(trace, None, "the search prices runs against its oracle")
    exp = A.experiment(A.CASES[trace], None, 64, seed=seed, cold_start_s=cold_start_s, flips=True)
    law = exp.law("slo")
    law.config = dataclasses.replace(law.config, **config(i))
    if not smooth_regime:
        law.config = dataclasses.replace(law.config, smooth_regime=None)
    s = summary(simulate(exp.requests, A.settings_of(exp), law, tuple(base["initial"])))
    return {"cfg": i, "trace": trace, "cold": cold_start_s, "seed": seed, "att": s["feasible_attainment"],
            "gpu": round(s["gpu_seconds"] / base["policies"]["oracle"]["gpu_seconds"], 3)}


def met(att: float, gpu: float) -> bool:
    return att >= A.TARGET and gpu <= A.GOAL_COST


def report(lines: list[dict[str, Any]]) -> dict[str, Any]:
    configs = lines[0]["configs"]
    runs: dict[int, dict[tuple[str, float], tuple[float, float]]] = {}
    for r in lines[1:]:
        runs.setdefault(r["cfg"], {})[(r["trace"], r["cold"])] = (r["att"], r["gpu"])
    complete = {i: d for i, d in runs.items() if len(d) == len(RUNS)}

    def goals(d: dict) -> list[str]:
        return [f"{t}@{c:g}" for (t, c), (a, g) in sorted(d.items()) if t in SHARED and met(a, g)]

    order = sorted(complete, key=lambda i: (-len(goals(complete[i])), i))
    cols = [(t, c) for t in ("azure_conv", "mooncake", "azure_code", "bursty") for c in (20.0, 150.0)]
    print(f"{len(complete)} of {len(configs)} configs complete (the rest cut short); attainment of feasible / "
          "GPU-s x oracle, seed 0, with flips")
    print("| config | goals met | " + " | ".join(f"{t} {c:g} s" for t, c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for i in order:
        d = complete[i]
        print(f"| {i}{' (defaults)' if i == 0 else ''} | {len(goals(d))} | "
              + " | ".join(f"{d[k][0]:.3f} / {d[k][1]:.2f}" for k in cols) + " |")
    best = max((len(goals(d)) for d in complete.values()), default=0)
    return {"search": {"configs_complete": len(complete), "configs_drawn": len(configs),
                       "defaults_meet": goals(complete[0]) if 0 in complete else None, "most_goals_met": best,
                       "configs_meeting_most": {str(i): goals(complete[i]) for i in order
                                                if len(goals(complete[i])) == best}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=int, default=50, help="random configs beside the defaults")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the traces' copies' jitter")
    ap.add_argument("--no-smooth-regime", action="store_true", help="the law without its smooth regime")
    ap.add_argument("--report", action="store_true", help="only the table of the last results file")
    args = ap.parse_args()
    if not args.report:
        ids = range(args.configs + 1)
        with OUT.open("w") as out, ProcessPoolExecutor(max_workers=args.jobs) as pool:
            out.write(json.dumps({"configs": {i: config(i) for i in ids}, "seed": args.seed,
                                  "smooth_regime": not args.no_smooth_regime, "machine": A.machine()}) + "\n")
            # the slowest trace first, so the last runs are short ones
            todo = sorted(((i, t, c) for i in ids for t, c in RUNS), key=lambda x: x[1] != "azure_conv")
            regime = not args.no_smooth_regime
            for f in as_completed([pool.submit(task, i, t, c, args.seed, regime) for i, t, c in todo]):
                out.write(json.dumps(f.result()) + "\n")
                out.flush()
    lines = [json.loads(line) for line in OUT.read_text().splitlines() if line.strip()]
    print(json.dumps(report(lines)))


if __name__ == "__main__":
    main()
