"""Our gateway in front of a vLLM worker against vLLM's own OpenAI server alone, on this machine's CPU, with
`splitserve bench`:

  gateway  `splitserve up --engine vllm --mode colocated --decode 1` (the gateway, one splitserve worker and
           the stock vLLM CPU server that worker starts as its child)
  vllm     that vLLM server alone: the command line and environment our worker would give it for role `both`
           (splitserve.vllm_engine.server.command / environment), started here directly

One after the other, never both at once (a 2-core machine), on one Poisson workload (fixed-length prompts, light
enough that requests rarely overlap: what differs is each request's path, not a backlog), after one warm-up
request each. The target is TTFT and ITL p50 of `gateway` within 5% of `vllm`. Also reports each one's ready time
(start to serving), memory (PSS of its whole process tree, ready and idle) and the load average during the run.
Prints a table and ends with one JSON line; `--save NAME` writes benchmarks/results/serving_vllm_cpu_NAME.json and
.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import (
    Cluster,
    bench_poisson,
    finish,
    kill_leftovers,
    markdown_table,
    process_tree,
    pss_bytes,
    ratio,
    report,
    run_bench,
    save,
    snapshot,
)

from splitserve.common.proc import free_port

KEYS = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "output_tok_s")
OVERRIDES = {"engine": "vllm", "mode": "colocated", "decode.replicas": 1}  # what `up`'s flags below set
UP_ARGS = ["up", "--engine", "vllm", "--mode", "colocated", "--decode", "1"]


def gateway(timeout: float) -> Cluster:
    """`splitserve up --engine vllm ...`: ready at its `splitserve ready` line, every worker healthy."""
    return Cluster(*UP_ARGS[1:], timeout=timeout, name="gateway")


class Vllm:
    """vLLM's OpenAI server alone, exactly as our worker would start it for role `both`, in its own session;
    ready once GET /health answers 200."""

    name = "vllm"

    def __init__(self, timeout: float) -> None:
        from splitserve.common.config_file import load
        from splitserve.common.model_files import resolve_model
        from splitserve.vllm_engine.server import VllmPorts, VllmServer, VllmStartError, command, environment

        self.left_behind: list[int] = []
        spec = load(None, OVERRIDES, {}).spec
        ports = VllmPorts(free_port(), free_port(), free_port())
        self.url = f"http://127.0.0.1:{ports.http}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serving_vllm_cpu-", suffix=".log", delete=False)
        self.server = VllmServer(command(spec, "both", str(resolve_model(spec.model.name)), ports),
                                 {"PYTHONUNBUFFERED": "1", **environment(spec, "both", ports, "127.0.0.1")},
                                 self.url, timeout, output=self.log)
        t0 = time.monotonic()
        self.server.start()
        self.proc = self.server.proc
        try:
            self.server.wait_healthy()
        except VllmStartError as e:
            self.stop()
            raise RuntimeError(f"vllm: {e}:\n" + self.log_tail()) from None
        self.ready_s = time.monotonic() - t0

    def log_tail(self) -> str:
        return "".join(Path(self.log.name).read_text(errors="replace").splitlines(keepends=True)[-30:])

    def pids(self) -> set[int]:
        return process_tree(self.proc.pid)

    def stop(self) -> float:
        """Seconds to stop; `left_behind`: the pids of its tree killed after it stopped (none when it stops
        cleanly)."""
        t0 = time.monotonic()
        tree = snapshot(self.pids())
        self.server.stop()
        elapsed = time.monotonic() - t0
        self.left_behind = kill_leftovers(tree)
        self.log.close()
        return elapsed


class LoadSampler:
    """The 1-minute load average every few seconds while the bench runs (a 2-core machine: above ~2, something
    else competes for the cores)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(os.getloadavg()[0])

    def done(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        return {"loadavg_start": round(self.samples[0], 2), "loadavg_max": round(max(self.samples), 2),
                "loadavg_end": round(self.samples[-1], 2)}


def warm(url: str, args: argparse.Namespace) -> None:
    """`args.warmup` requests one at a time, of the run's lengths but other prompts (bench's seed is 1: the same
    prompts would turn the run's first requests into prefix-cache hits)."""
    for i in range(args.warmup):
        run_bench(url, "--rate", "0", "--num-requests", "1", "--input-len", str(args.input_len), "--output-len",
                  str(args.output_len), "--seed", str(1000 + i), timeout=600)


SUBJECTS = {"gateway": gateway, "vllm": Vllm}


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in args.order.split(","):
        load_before = os.getloadavg()[0]
        s = SUBJECTS[name](args.startup_timeout)
        print(f"{name}: ready in {s.ready_s:.1f} s ({s.url})", file=sys.stderr, flush=True)
        try:
            time.sleep(3)  # settle: the idle tree, not the start
            idle = pss_bytes(s.pids())
            if args.warmup:  # its first request pays one-off costs (first kernels, first allocations)
                warm(s.url, args)
            sampler = LoadSampler()
            summary = bench_poisson(s.url, args)
            load = sampler.done()
        except BaseException:
            print(f"{name} failed; its log's tail:\n{s.log_tail()}", file=sys.stderr, flush=True)
            raise
        finally:
            stop_s = s.stop()
        killed = s.left_behind
        if killed:
            print(f"{name}: killed {len(killed)} process(es) left after stopping: {killed}", file=sys.stderr)
        out[name] = {**{k: summary.get(k) for k in KEYS}, "ready_s": round(s.ready_s, 1), "stop_s": round(stop_s, 1),
                     "pss_idle_gb": round(idle / 2**30, 3), "loadavg_before_start": round(load_before, 2), **load,
                     "left_after_stop": len(killed)}
        print(f"{name}: ttft p50 {summary.get('ttft_p50_s')} s, itl p50 {summary.get('itl_p50_s')} s, "
              f"pss {idle / 2**30:.2f} GB, load max {load['loadavg_max']}", file=sys.stderr, flush=True)
        time.sleep(5)  # the next one starts on quiet cores
    return out


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    gw, vl = runs["gateway"], runs["vllm"]
    out = {"ttft_p50_ratio": ratio(gw, vl, "ttft_p50_s"), "itl_p50_ratio": ratio(gw, vl, "itl_p50_s"),
           "ttft_p50_added_ms": None if gw.get("ttft_p50_s") is None or vl.get("ttft_p50_s") is None
           else round((gw["ttft_p50_s"] - vl["ttft_p50_s"]) * 1000, 1),
           "ready_added_s": round(gw["ready_s"] - vl["ready_s"], 1),
           "memory_overhead_gb": round(gw["pss_idle_gb"] - vl["pss_idle_gb"], 3)}
    out["within_5pct"] = all(r is not None and r <= 1.05 for r in (out["ttft_p50_ratio"], out["itl_p50_ratio"]))
    return out


def table(runs: dict[str, dict[str, Any]], cmp: dict[str, Any]) -> str:
    cols = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "output_tok_s",
            "ready_s", "stop_s", "pss_idle_gb", "loadavg_start", "loadavg_max")
    rows = markdown_table("server", runs, cols)
    rows.append("")
    rows.append(f"gateway/vllm: TTFT p50 x{cmp['ttft_p50_ratio']} ({cmp['ttft_p50_added_ms']:+} ms), ITL p50 "
                f"x{cmp['itl_p50_ratio']} (target <= 1.05: {'met' if cmp['within_5pct'] else 'missed'}); ready "
                f"{cmp['ready_added_s']:+} s; memory overhead {cmp['memory_overhead_gb']:+.2f} GB PSS idle")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # light enough that a 2-core box is not queue-bound: what differs is each request's path, not a backlog. (vLLM's
    # CPU prefill of 128 tokens takes ~3 s here, a request ~6 s: some requests still overlap another, the same ones
    # on both servers: seed 1. The p50s hold; e2e p50 swings between the overlapped and the lone requests.)
    p.add_argument("--requests", type=int, default=16, help="requests per server")
    p.add_argument("--rate", type=float, default=0.1, help="Poisson arrivals per second")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) before the run")
    p.add_argument("--order", default="gateway,vllm", choices=["gateway,vllm", "vllm,gateway"],
                   metavar="A,B", help="which starts first, one at a time: gateway,vllm or vllm,gateway")
    p.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds each may take to be ready")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/serving_vllm_cpu_NAME.json and .md")
    args = p.parse_args()
    runs = run(args)
    runs = {k: runs[k] for k in ("gateway", "vllm")}
    cmp = compare(runs)
    text = table(runs, cmp)
    result = {"command": " ".join(["splitserve", *UP_ARGS]), "workload": {
              "requests": args.requests, "rate": args.rate, "input_len": args.input_len,
              "output_len": args.output_len, "warmup": args.warmup, "order": args.order},
              "cpus": os.cpu_count(), "runs": runs, **cmp}
    if args.save:
        save(f"serving_vllm_cpu_{args.save}", result, report(
            "Our gateway in front of vLLM against vLLM's own server, CPU, this machine",
            f"`python benchmarks/serving_vllm_cpu.py --save {args.save}` ({args.requests} requests, Poisson "
            f"{args.rate}/s, {args.input_len} in / {args.output_len} out, {args.warmup} warm-up, "
            f"{args.order.replace(',', ' then ')}); gateway: `{result['command']}`; vllm: the same vLLM command "
            f"line and environment our worker uses (role both), alone", text, result))
    finish(text, result)


if __name__ == "__main__":
    main()
