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
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing import BIN, RESULTS, http_json, wait_until  # noqa: E402

from splitserve.common.proc import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "deploy" / "examples" / "local-cpu.yaml"
KEYS = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "output_tok_s")


def tree(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def pss_bytes(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
    return total


class Substrate:
    """One substrate's command as a child process in its own session (our SIGTERM reaches it alone)."""

    def __init__(self, name: str, args: list[str], timeout: float = 300.0) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_memory_monitor_refresh_ms="0")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([str(BIN / "splitserve"), *args, "-f", str(CLUSTER), "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.stderr: list[str] = []
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        threading.Thread(target=lambda: ([lines.put(x) for x in self.proc.stdout], lines.put(None)),
                         daemon=True).start()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None or "splitserve ready" in line:
                break
        else:
            line = None
        if not line:
            self.stop()
            raise RuntimeError(f"{name} did not start:\n" + "".join(self.stderr[-20:]))
        wait_until(lambda: http_json(self.url + "/health")["all_healthy"], 120, "workers")
        self.ready_s = time.monotonic() - t0

    def pss(self) -> int:
        return pss_bytes(tree(self.proc.pid))

    def stop(self) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return time.monotonic() - t0


def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    res = subprocess.run([str(BIN / "splitserve"), "bench", "--url", url, "--model", "smollm2", "--rate",
                          str(args.rate), "--num-requests", str(args.requests), "--input-len", str(args.input_len),
                          "--output-len", str(args.output_len), "--seed", "1", "--json", "--no-progress"],
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"splitserve bench failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


SUBSTRATES = {"up": ["up"], "ray": ["serve-ray", "--num-cpus", str(os.cpu_count() or 2)]}


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, cmd in SUBSTRATES.items():
        s = Substrate(name, [*cmd, "--kv-transport", args.kv_transport])
        try:
            time.sleep(3)  # settle: the idle tree, not the start
            idle = s.pss()
            load = os.getloadavg()[0]
            summary = bench(s.url, args)
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

    def ratio(key: str) -> float | None:
        return round(ray[key] / up[key], 3) if up.get(key) and ray.get(key) is not None else None

    out = {"ttft_p50_ratio": ratio("ttft_p50_s"), "itl_p50_ratio": ratio("itl_p50_s"),
           "memory_overhead_gb": round(ray["pss_idle_gb"] - up["pss_idle_gb"], 3)}
    out["within_10pct"] = all(r is not None and r <= 1.10 for r in (out["ttft_p50_ratio"], out["itl_p50_ratio"]))
    return out


def table(runs: dict[str, dict[str, Any]], cmp: dict[str, Any]) -> str:
    cols = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "output_tok_s", "ready_s",
            "stop_s", "pss_idle_gb", "pss_after_gb", "loadavg_at_start")
    rows = ["| substrate | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, r in runs.items():
        rows.append(f"| {name} | " + " | ".join("-" if r.get(c) is None else f"{r[c]:g}" if isinstance(r[c], float)
                                               else str(r[c]) for c in cols) + " |")
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
    print(text)
    result = {"cluster": str(CLUSTER.relative_to(ROOT)), "workload": {"requests": args.requests, "rate": args.rate,
              "input_len": args.input_len, "output_len": args.output_len, "kv_transport": args.kv_transport},
              "cpus": os.cpu_count(), "runs": runs, **cmp}
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"serving_ray_{args.save}.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / f"serving_ray_{args.save}.md").write_text(
            f"# `splitserve up` against `serve-ray`, {CLUSTER.name}, this machine\n\n"
            f"`python benchmarks/serving_ray.py --save {args.save}` ({args.requests} requests, Poisson "
            f"{args.rate}/s, {args.input_len} in / {args.output_len} out, kv {args.kv_transport})\n\n{text}\n\n"
            + json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
