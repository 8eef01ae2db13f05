"""The same cluster document on two substrates, on this machine, with `splitserve bench`:

  up   `splitserve up -f deploy/examples/local-cpu.yaml` (local processes)
  ray  `splitserve serve-ray -f deploy/examples/local-cpu.yaml` (a local Ray, Serve application)

Both serve one Poisson workload (fixed-length prompts); the target is TTFT and ITL p50 on Ray within 10% of
`up`. Memory is the proportional set size (PSS: shared pages split between their users) of each substrate's
whole process tree once it is ready and idle, and again after the run; the difference is Ray's overhead.
Prints a table and ends with one JSON line; `--save NAME` writes benchmarks/results/serving_ray_NAME.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from harness import ROOT, Cluster, bench_poisson, finish, markdown_table, ratio, report, save

CLUSTER = ROOT / "deploy" / "examples" / "local-cpu.yaml"
KEYS = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "output_tok_s")
SUBSTRATES = {"up": ("up", []), "ray": ("serve-ray", ["--num-cpus", str(os.cpu_count() or 2)])}


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, (command, flags) in SUBSTRATES.items():
        s = Cluster(*flags, "--kv-transport", args.kv_transport, command=command, file=CLUSTER, name=name,
                    env={"RAY_memory_monitor_refresh_ms": "0"}, timeout=420)
        try:
            time.sleep(3)  # settle: the idle tree, not the start
            idle = s.pss()
            load = os.getloadavg()[0]
            summary = bench_poisson(s.url, args)
            busy = s.pss()
        finally:
            stop_s = s.stop()
        out[name] = {**{k: summary.get(k) for k in KEYS}, "ready_s": round(s.ready_s, 1), "stop_s": round(stop_s, 1),
                     "pss_idle_gb": round(idle / 2**30, 3), "pss_after_gb": round(busy / 2**30, 3),
                     "loadavg_at_start": round(load, 2)}
        print(f"{name}: ttft p50 {summary.get('ttft_p50_s')} s, itl p50 {summary.get('itl_p50_s')} s, "
              f"pss {idle / 2**30:.2f} GB", file=sys.stderr, flush=True)
    return out


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    up, ray = runs["up"], runs["ray"]
    out = {"ttft_p50_ratio": ratio(ray, up, "ttft_p50_s"), "itl_p50_ratio": ratio(ray, up, "itl_p50_s"),
           "memory_overhead_gb": round(ray["pss_idle_gb"] - up["pss_idle_gb"], 3)}
    out["within_10pct"] = all(r is not None and r <= 1.10 for r in (out["ttft_p50_ratio"], out["itl_p50_ratio"]))
    return out


def table(runs: dict[str, dict[str, Any]], cmp: dict[str, Any]) -> str:
    cols = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "output_tok_s", "ready_s",
            "stop_s", "pss_idle_gb", "pss_after_gb", "loadavg_at_start")
    rows = markdown_table("substrate", runs, cols)
    rows.append("")
    rows.append(f"ray/up: TTFT p50 x{cmp['ttft_p50_ratio']}, ITL p50 x{cmp['itl_p50_ratio']} (target <= 1.10: "
                f"{'met' if cmp['within_10pct'] else 'missed'}); memory overhead {cmp['memory_overhead_gb']:+.2f} GB "
                "PSS idle")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # light enough that a 2-core box is not queue-bound: what differs is each request's path, not a backlog
    p.add_argument("--requests", type=int, default=20, help="requests per substrate")
    p.add_argument("--rate", type=float, default=0.15, help="Poisson arrivals per second")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-transport", default="tcp", choices=["auto", "nixl", "tcp"])
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/serving_ray_NAME.json and .md")
    args = p.parse_args()
    runs = run(args)
    cmp = compare(runs)
    text = table(runs, cmp)
    result = {"cluster": str(CLUSTER.relative_to(ROOT)), "workload": {"requests": args.requests, "rate": args.rate,
              "input_len": args.input_len, "output_len": args.output_len, "kv_transport": args.kv_transport},
              "cpus": os.cpu_count(), "runs": runs, **cmp}
    if args.save:
        save(f"serving_ray_{args.save}", result, report(
            f"`splitserve up` against `serve-ray`, {CLUSTER.name}, this machine",
            f"`python benchmarks/serving_ray.py --save {args.save}` ({args.requests} requests, Poisson {args.rate}/s, "
            f"{args.input_len} in / {args.output_len} out, kv {args.kv_transport})", text, result))
    finish(text, result)


if __name__ == "__main__":
    main()
