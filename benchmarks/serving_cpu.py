"""Disaggregated against colocated serving on this CPU, at equal worker counts, with `splitserve bench`.

  disaggregated  `splitserve up` with 1 prefill + 1 decode worker (--disagg-threshold 128)
  colocated      `splitserve up --mode colocated --decode 2`

Each cluster serves two workloads: Poisson arrivals of fixed-length prompts, and a Mooncake conversation slice
(../shared/traces/mooncake_conversation.jsonl, clipped to SmolLM2's context). A fresh cluster per pair keeps
one run's cache out of the next. `--baseline FILE` puts an earlier run's figures beside these (a JSON written
by this script, or the Markdown of the first comparison, whose JSON lines it reads). Prints a table and ends
with one JSON line; `--save NAME` writes benchmarks/results/serving_NAME.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from harness import TRACES, Cluster, run_bench, save

MODES = {"disagg": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--disagg-threshold", "128"],
         "colocated": ["--mode", "colocated", "--decode", "2"]}
KEYS = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "output_tok_s",
        "goodput_rps")


def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    slo = ["--slo-ttft", "3", "--slo-itl", "0.5"]
    return {
        "poisson": ["--rate", str(args.rate), "--num-requests", str(args.requests), "--input-len", "384",
                    "--output-len", "32", "--seed", "1", *slo],
        "trace": ["--trace", str(TRACES / "mooncake_conversation.jsonl"), "--num-requests", str(args.requests),
                  "--time-scale", "0.5", "--max-input-len", "512", "--max-output-len", "32", *slo],
    }


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for mode, flags in MODES.items():
        for name, wl in workloads(args).items():
            with Cluster(*flags, "--kv-transport", args.kv_transport, name=f"{mode}-{name}") as cluster:
                load = os.getloadavg()[0]
                summary = run_bench(cluster.url, *wl)
            out[f"{mode}/{name}"] = {**{k: summary.get(k) for k in KEYS}, "load_1m_before": round(load, 2)}
            print(f"{mode}/{name}: ttft p50 {summary['ttft_p50_s']} s", file=sys.stderr, flush=True)
    return out


def read_baseline(path: Path) -> dict[str, dict[str, Any]]:
    """An earlier run: this script's JSON, or the first comparison's Markdown (## <mode>, <workload> sections, each
    with one JSON line)."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)["runs"]
    runs = {}
    for mode, name, body in re.findall(r"^## (\w+), (\w+)\n(.*?)(?=^## |\Z)", text, re.M | re.S):
        line = next(x for x in body.splitlines() if x.startswith("{"))
        runs[f"{mode}/{name}"] = {k: json.loads(line).get(k) for k in KEYS}
    return runs


def table(runs: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]]) -> str:
    cols = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "output_tok_s", "goodput_rps", "failed")
    lines = [f"{'run':20s}" + "".join(f"{c:>16s}" for c in cols)]
    for key, r in runs.items():
        lines.append(f"{key:20s}" + "".join(f"{_fmt(r.get(c)):>16s}" for c in cols))
        if key in base:
            lines.append(f"{'  before':20s}" + "".join(f"{_fmt(base[key].get(c)):>16s}" for c in cols))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--kv-transport", default="auto", choices=("auto", "nixl", "tcp"))
    p.add_argument("--baseline", type=Path, help="an earlier run to compare with")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/serving_NAME.json and .md")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    args = p.parse_args()
    started = time.time()
    runs = run(args)
    base = read_baseline(args.baseline) if args.baseline else {}
    text = table(runs, base)
    print(text)
    result = {"runs": runs, "baseline": base, "baseline_file": str(args.baseline) if args.baseline else None,
              "cpus": os.cpu_count(), "duration_s": round(time.time() - started, 1)}
    if args.save:
        save(f"serving_{args.save}", result, f"# benchmarks/serving_cpu.py ({args.save})\n\n```\n{text}\n```\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
