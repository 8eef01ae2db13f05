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
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing import BIN, RESULTS, http_json, wait_until  # noqa: E402
from serving_ray import bench, pss_bytes, tree  # noqa: E402

from splitserve.common.proc import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "output_tok_s")
OVERRIDES = {"engine": "vllm", "mode": "colocated", "decode.replicas": 1}  # what `up`'s flags below set
UP_ARGS = ["up", "--engine", "vllm", "--mode", "colocated", "--decode", "1"]
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def _kill_pids(pids: set[int]) -> list[int]:
    """SIGKILL those of `pids` (a tree we started, taken before stopping it) still alive; the ones it killed."""
    left = []
    for pid in sorted(pids):
        try:
            os.kill(pid, signal.SIGKILL)
            left.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return left


class Gateway:
    """`splitserve up --engine vllm ...` as a child in its own session: ready at its `splitserve ready` line and
    once the gateway reports every worker healthy."""

    name = "gateway"

    def __init__(self, timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        t0 = time.monotonic()
        self.proc = subprocess.Popen([str(BIN / "splitserve"), *UP_ARGS, "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV,
                                     start_new_session=True)
        self.stderr: list[str] = []
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        threading.Thread(target=lambda: ([lines.put(x) for x in self.proc.stdout], lines.put(None)),
                         daemon=True).start()
        deadline = t0 + timeout
        line: str | None = None
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None or "splitserve ready" in line:
                break
        if not line:
            self.stop()
            raise RuntimeError("gateway did not start:\n" + self.log_tail())
        try:
            wait_until(lambda: http_json(self.url + "/health")["all_healthy"], 120, "workers")
        except RuntimeError:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0

    def log_tail(self) -> str:
        return "".join(self.stderr[-30:])

    def pids(self) -> set[int]:
        return tree(self.proc.pid)

    def stop(self) -> tuple[float, list[int]]:
        """Seconds to stop; pids of its tree that had to be killed afterwards (none when it stops cleanly)."""
        t0 = time.monotonic()
        before = self.pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        elapsed = time.monotonic() - t0
        time.sleep(1.0)
        return elapsed, _kill_pids(before - {self.proc.pid})


class Vllm:
    """vLLM's OpenAI server alone, exactly as our worker would start it for role `both`, in its own session;
    ready once GET /health answers 200."""

    name = "vllm"

    def __init__(self, timeout: float) -> None:
        from splitserve.common.config_file import load
        from splitserve.common.model_files import resolve_model
        from splitserve.vllm_engine.server import VllmPorts, VllmServer, VllmStartError, command, environment

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
        return tree(self.proc.pid)

    def stop(self) -> tuple[float, list[int]]:
        t0 = time.monotonic()
        before = self.pids()
        self.server.stop(30.0)
        elapsed = time.monotonic() - t0
        time.sleep(1.0)
        self.log.close()
        return elapsed, _kill_pids(before - {self.proc.pid})


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
        res = subprocess.run([str(BIN / "splitserve"), "bench", "--url", url, "--model", "smollm2", "--rate", "0",
                              "--num-requests", "1", "--input-len", str(args.input_len), "--output-len",
                              str(args.output_len), "--seed", str(1000 + i), "--json", "--no-progress"],
                             capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"warm-up request failed: {res.stderr[-2000:]}")


SUBJECTS = {"gateway": Gateway, "vllm": Vllm}


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
            summary = bench(s.url, args)
            load = sampler.done()
        except BaseException:
            print(f"{name} failed; its log's tail:\n{s.log_tail()}", file=sys.stderr, flush=True)
            raise
        finally:
            stop_s, killed = s.stop()
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

    def ratio(key: str) -> float | None:
        return round(gw[key] / vl[key], 3) if vl.get(key) and gw.get(key) is not None else None

    out = {"ttft_p50_ratio": ratio("ttft_p50_s"), "itl_p50_ratio": ratio("itl_p50_s"),
           "ttft_p50_added_ms": None if gw.get("ttft_p50_s") is None or vl.get("ttft_p50_s") is None
           else round((gw["ttft_p50_s"] - vl["ttft_p50_s"]) * 1000, 1),
           "ready_added_s": round(gw["ready_s"] - vl["ready_s"], 1),
           "memory_overhead_gb": round(gw["pss_idle_gb"] - vl["pss_idle_gb"], 3)}
    out["within_5pct"] = all(r is not None and r <= 1.05 for r in (out["ttft_p50_ratio"], out["itl_p50_ratio"]))
    return out


def table(runs: dict[str, dict[str, Any]], cmp: dict[str, Any]) -> str:
    cols = ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "output_tok_s",
            "ready_s", "stop_s", "pss_idle_gb", "loadavg_start", "loadavg_max")
    rows = ["| server | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, r in runs.items():
        rows.append(f"| {name} | " + " | ".join("-" if r.get(c) is None else f"{r[c]:g}" if isinstance(r[c], float)
                                               else str(r[c]) for c in cols) + " |")
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
    print(text)
    result = {"command": " ".join(["splitserve", *UP_ARGS]), "workload": {
              "requests": args.requests, "rate": args.rate, "input_len": args.input_len,
              "output_len": args.output_len, "warmup": args.warmup, "order": args.order},
              "cpus": os.cpu_count(), "runs": runs, **cmp}
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"serving_vllm_cpu_{args.save}.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / f"serving_vllm_cpu_{args.save}.md").write_text(
            f"# Our gateway in front of vLLM against vLLM's own server, CPU, this machine\n\n"
            f"`python benchmarks/serving_vllm_cpu.py --save {args.save}` ({args.requests} requests, Poisson "
            f"{args.rate}/s, {args.input_len} in / {args.output_len} out, {args.warmup} warm-up, "
            f"{args.order.replace(',', ' then ')}); gateway: `{result['command']}`; vllm: the same vLLM command "
            f"line and environment our worker uses (role both), alone\n\n{text}\n\n" + json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
