"""The goodput matrix: each engine (native, vllm) colocated and disaggregated on one host's GPUs, Azure code and
Azure conversation replayed at two rates each (one where colocation keeps up, one where it falls behind), the same
SLO for every row, after an unmeasured warm-up run of each trace on each cluster.

Configurations by GPU count (--gpus): 1: colocated (one worker); 2: colocated (2 workers) and 1p1d; 4: colocated
(4 workers), 1p3d and 2p2d. One GPU per worker, random weights of --shape (the harness's `PlacedCluster`, as
`serving_gpu.py` and `serving_vllm_gpu.py` run them); both engines get the same flags (--max-num-batched-tokens,
--max-num-seqs, --kv-cache-memory); native workers that decode also get --max-prefill-tokens-while-decoding.
Rates are per GPU (--rates), times the GPUs of the configuration, so every configuration of a trace sees the
same per-GPU load.

Each invocation runs the clusters of --engines x --configs (one cluster each); one engine and one configuration
(a start, two warm-ups, four measured runs) fits in ten minutes on an H200 host; --budget-s stops starting new runs
past that. Rows go to benchmarks/results/goodput_matrix_<host>.json (under $OUT when set), merged with the rows
already there (a row is replaced by a new one of the same engine, config, GPUs, trace and rate), written after
every run: a list `rows` of {engine, config, gpus, trace, offered_rps, goodput_per_gpu, ttft_p50_s, itl_p99_s,
completed, failed, ...}. Prints a table (with disaggregated / colocated per GPU), then the JSON line.

The full Azure traces live outside the checkout (--trace-dir, SPLITSERVE_TRACES); --write-slices DIR copies the
first --slice-rows rows of each into DIR, small enough to carry to a machine that has no ../shared.
`--device cpu --shape tiny` runs the same orchestration on the CPU (engine native).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import (
    RESULTS,
    SHAPES,
    TRACE_FILES,
    TRACES,
    PlacedCluster,
    fmt,
    model_dir,
    out_path,
    replay_at_rate,
)

PLANS = {1: ("colocated",), 2: ("colocated", "1p1d"), 4: ("colocated", "1p3d", "2p2d")}
SPLITS = {"1p1d": (1, 1), "1p3d": (1, 3), "2p2d": (2, 2)}  # (prefill workers, decode workers), one GPU each
ENGINES = ("native", "vllm")
ROW_KEYS = ("engine", "config", "gpus", "trace", "offered_rps", "goodput_per_gpu", "ttft_p50_s", "itl_p99_s",
            "completed", "failed")
# per-run seconds beside its arrivals, for the budget: the stragglers' drain and the bench's own start
RUN_OVERHEAD_S = 25.0
START_S = {"native": 90.0, "vllm": 180.0}  # a cluster's start on an H200 host (dummy 8B weights, graphs), for planning


def configs_for(gpus: int, asked: str) -> list[str]:
    """The configurations of --configs (all of the plan when empty) that run on `gpus` GPUs."""
    plan = PLANS[gpus]
    if not asked:
        return list(plan)
    chosen = asked.split(",")
    bad = [c for c in chosen if c not in plan]
    if bad:
        raise ValueError(f"--configs: {','.join(bad)} do not run on {gpus} GPU(s) (choose from {','.join(plan)})")
    return chosen


def worker_flags(args, engine: str, role: str) -> list[str]:
    flags = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
             "--kv-cache-memory", args.kv_cache_memory]
    if engine == "vllm":
        flags += ["--engine", "vllm", "--vllm-args", f"--gpu-memory-utilization,{args.vllm_gpu_share}"]
    elif role != "prefill" and args.max_prefill_tokens_while_decoding:
        flags += ["--max-prefill-tokens-while-decoding", str(args.max_prefill_tokens_while_decoding)]
    return flags


def placement(args, engine: str, config: str, gpus: int) -> tuple[str, list[tuple[str, list[int], list[str]]]]:
    """(cluster mode, workers as (role, GPU ids, flags)) of one configuration."""
    if config == "colocated":
        return "colocated", [("both", [i], worker_flags(args, engine, "both")) for i in range(gpus)]
    n_pre, n_dec = SPLITS[config]
    return "disaggregated", ([("prefill", [i], worker_flags(args, engine, "prefill")) for i in range(n_pre)]
                             + [("decode", [n_pre + i], worker_flags(args, engine, "decode")) for i in range(n_dec)])


def parse_rates(text: str, traces: list[str]) -> dict[str, list[float]]:
    """--rates: per trace, requests/s per GPU, several separated by /."""
    rates: dict[str, list[float]] = {}
    for item in text.split(","):
        name, _, values = item.partition("=")
        try:
            rates[name] = [float(v) for v in values.split("/")]
        except ValueError:
            raise ValueError(f"--rates: {item!r} is not TRACE=RATE[/RATE...]") from None
        if not rates[name] or min(rates[name]) <= 0:
            raise ValueError(f"--rates: {item!r}: rates must be above 0")
    missing = [t for t in traces if t not in rates]
    if missing:
        raise ValueError(f"--rates: no rate for {','.join(missing)}")
    return rates


def plan_seconds(args, engines: list[str], configs: list[str], rates: dict[str, list[float]]) -> float:
    """What the invocation should take: starts, warm-ups and runs."""
    per_cluster = sum(args.warmup_duration + RUN_OVERHEAD_S for _ in rates if args.warmup_duration > 0) + \
        sum(args.duration + RUN_OVERHEAD_S for r in rates.values() for _ in r)
    return sum(START_S[e] + per_cluster for e in engines for _ in configs)


# -- results ---------------------------------------------------------------------------------------------------
def host_tag(args, gpu: str | None) -> str:
    return args.tag or ((gpu or "cpu").split()[-1].lower())


def row_key(r: dict) -> tuple:
    return (r["engine"], r["config"], r["gpus"], r["trace"], r["offered_rps"])


class Matrix:
    """The result file: rows already there (read from benchmarks/results), merged with this invocation's."""

    def __init__(self, name: str, out: str, meta: dict) -> None:
        self.path = out_path(name, out)
        existing = Path(out) if out else RESULTS / name
        self.doc: dict = json.loads(existing.read_text()) if existing.is_file() else {"rows": []}
        self.doc.update(meta)

    def add(self, row: dict) -> None:
        self.doc["rows"] = [r for r in self.doc["rows"] if row_key(r) != row_key(row)] + [row]
        self.doc["rows"].sort(key=lambda r: (r["gpus"], r["trace"], r["offered_rps"], r["engine"], r["config"]))
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.doc, indent=1) + "\n")


def make_row(engine: str, config: str, gpus: int, trace: str, res: dict, counters: dict | None) -> dict:
    row = {"engine": engine, "config": config, "gpus": gpus, "trace": trace, "offered_rps": res["offered_rps"],
           "goodput_per_gpu": round((res.get("goodput_rps") or 0.0) / gpus, 4),
           "ttft_p50_s": res.get("ttft_p50_s"), "itl_p99_s": res.get("itl_p99_s"),
           "completed": res.get("completed", 0), "failed": res.get("failed", res.get("requests", 0))}
    row.update({k: res.get(k) for k in ("goodput_rps", "ttft_p99_s", "itl_p50_s", "requests", "duration_s")})
    if "error" in res:
        row["error"] = res["error"]
    if counters:
        row["prefill_counters"] = counters
    return row


def ratios(rows: list[dict]) -> list[tuple]:
    """(engine, gpus, trace, rate, config, disaggregated / colocated goodput per GPU) for each split measured."""
    colocated = {(r["engine"], r["gpus"], r["trace"], r["offered_rps"] / r["gpus"]): r["goodput_per_gpu"]
                 for r in rows if r["config"] == "colocated"}
    out = []
    for r in rows:
        if r["config"] == "colocated":
            continue
        base = colocated.get((r["engine"], r["gpus"], r["trace"], r["offered_rps"] / r["gpus"]))
        out.append((r["engine"], r["gpus"], r["trace"], r["offered_rps"], r["config"],
                    round(r["goodput_per_gpu"] / base, 3) if base else None))
    return out


def table(doc: dict) -> str:
    lines = [f"{'engine':<7}{'config':<10}{'gpus':>4} {'trace':<11}{'rps':>6}{'goodput/GPU':>12}{'ttft p50':>10}"
             f"{'itl p99':>9}{'done':>6}{'failed':>7}"]
    for r in doc["rows"]:
        lines.append(f"{r['engine']:<7}{r['config']:<10}{r['gpus']:>4} {r['trace']:<11}{fmt(r['offered_rps'], 1, 6)}"
                     f"{fmt(r['goodput_per_gpu'], 3, 12)}{fmt(r['ttft_p50_s'], 3, 10)}{fmt(r['itl_p99_s'], 3, 9)}"
                     f"{r['completed']:>6}{r['failed']:>7}")
    for engine, gpus, trace, rate, config, ratio in ratios(doc["rows"]):
        lines.append(f"{engine} {config} / colocated on {gpus} GPUs, {trace} at {rate:g} req/s: {fmt(ratio, 3)}")
    return "\n".join(lines)


# -- running ---------------------------------------------------------------------------------------------------
def run_cluster(args, model: Path, logs: Path, engine: str, config: str, gpus: int, rates: dict[str, list[float]],
                matrix: Matrix, deadline: float) -> None:
    """One cluster: each trace's warm-up, then its rates, a row each (written as it comes)."""
    mode, workers = placement(args, engine, config, gpus)
    name = f"{engine}-{config}-{gpus}gpu"
    router = ("--spill-backlog", str(args.spill_backlog)) if args.spill_backlog is not None else ()
    try:
        cluster = PlacedCluster(args, model, mode, workers, logs, name, router_args=router)
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"[{name}] did not start: {e}", file=sys.stderr, flush=True)
        for trace, per_gpu in rates.items():
            for rate in per_gpu:
                matrix.add(make_row(engine, config, gpus, trace, {"offered_rps": rate * gpus, "error": str(e)[-500:]},
                                    None))
        return
    with cluster as c:
        seed = 0
        for trace, per_gpu in rates.items():
            if args.warmup_duration > 0 and time.monotonic() + args.warmup_duration + RUN_OVERHEAD_S < deadline:
                try:  # the first pass of a trace's lengths builds kernels; its numbers are not kept
                    replay_at_rate(args, c.url, trace, max(per_gpu) * gpus, seed=1000, duration=args.warmup_duration,
                                   request_timeout=args.request_timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"[{name} {trace}] warm-up failed: {e}", file=sys.stderr, flush=True)
            for rate in per_gpu:
                seed += 1
                offered = rate * gpus
                if time.monotonic() + args.duration + RUN_OVERHEAD_S > deadline:
                    print(f"[{name} {trace} @{offered:g}] skipped: past --budget-s", file=sys.stderr, flush=True)
                    continue
                before = c.counters() if mode == "disaggregated" else {}
                try:
                    res = replay_at_rate(args, c.url, trace, offered, seed=seed, request_timeout=args.request_timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    res = {"offered_rps": offered, "error": str(e)[-500:]}
                counters = None
                if mode == "disaggregated" and "error" not in res:
                    after = c.counters()
                    counters = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
                row = make_row(engine, config, gpus, trace, res, counters)
                print(f"[{name} {trace} @{offered:g}] goodput/GPU {row['goodput_per_gpu']} ttft p50 "
                      f"{row['ttft_p50_s']} itl p99 {row['itl_p99_s']} failed {row['failed']} {counters or ''}",
                      file=sys.stderr, flush=True)
                matrix.add(row)


def write_slices(trace_dir: Path, into: Path, rows: int) -> list[Path]:
    """The first `rows` requests of each Azure trace (header kept) under the same file names in `into`."""
    into.mkdir(parents=True, exist_ok=True)
    written = []
    for name in TRACE_FILES.values():
        with open(trace_dir / name, newline="") as f:
            lines = [line for _, line in zip(range(rows + 1), f, strict=False)]
        (into / name).write_text("".join(lines))
        written.append(into / name)
    return written


def check_trace_rows(trace_dir: Path, rates: dict[str, list[float]], duration: float, gpus: int) -> str | None:
    """A trace file too short for the requests a run replays (rate x duration), in one line; None when all fit."""
    for trace, per_gpu in rates.items():
        path = trace_dir / TRACE_FILES[trace]
        if not path.is_file():
            return f"--trace-dir: no {path.name} in {trace_dir} (copy the full traces there, or --write-slices)"
        need = max(8, int(max(per_gpu) * gpus * duration))
        with open(path, newline="") as f:
            have = sum(1 for _ in csv.DictReader(f))
        if have < need:
            return f"--trace-dir: {path.name} has {have} requests; a run at {max(per_gpu) * gpus:g} req/s for " \
                   f"{duration:g} s replays {need}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, choices=sorted(PLANS), default=None,
                    help="GPUs of the configurations to run (default: the visible ones, if 1, 2 or 4)")
    ap.add_argument("--engines", default="native,vllm", help="comma-separated: native, vllm")
    ap.add_argument("--configs", default="", help="comma-separated, of the plan for --gpus (default: all of it)")
    ap.add_argument("--traces", default="azure_code,azure_conv")
    ap.add_argument("--rates", default="azure_code=1.5/3,azure_conv=3/6",
                    help="requests/s PER GPU for each trace, several separated by / (times the GPUs of a config)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per measured run")
    ap.add_argument("--warmup-duration", type=float, default=8.0,
                    help="seconds of arrivals of the unmeasured run of each trace on each cluster (0: none)")
    ap.add_argument("--request-timeout", type=float, default=60.0,
                    help="a request slower than this counts as failed (bounds a run that falls far behind)")
    ap.add_argument("--budget-s", type=float, default=500.0,
                    help="no run starts that would end past this many seconds from the start")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-itl", type=float, default=0.05, help="a request's own p99 inter-token latency, s")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-input-len", type=int, default=7168)
    ap.add_argument("--max-output-len", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default="40GiB", help="per worker")
    ap.add_argument("--vllm-gpu-share", type=float, default=0.85, help="engine vllm: --gpu-memory-utilization")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="both engines, every role")
    ap.add_argument("--max-prefill-tokens-while-decoding", type=int, default=1024,
                    help="engine native, workers that decode: prompt tokens in a step that decodes (0: off)")
    ap.add_argument("--disagg-threshold", type=int, default=512)
    ap.add_argument("--spill-backlog", type=int, default=None,
                    help="the gateway's router.spill.prefillBacklogTokens (default: the config model's, 16384; "
                         "0: never; e.g. 4096 lets the decode GPUs take prompts a busy prefill worker would queue)")
    ap.add_argument("--kv-transport", default="auto")
    ap.add_argument("--trace-dir", type=Path, default=TRACES,
                    help="folder of the Azure trace CSVs (a machine without ../shared needs them carried)")
    ap.add_argument("--write-slices", type=Path, default=None, metavar="DIR",
                    help="only write the first --slice-rows requests of each trace from --trace-dir into DIR")
    ap.add_argument("--slice-rows", type=int, default=1500)
    ap.add_argument("--tag", default=None, help="the file's host part (default: the GPU's name, e.g. h200)")
    ap.add_argument("--out", default="", help="result file (default: benchmarks/results/goodput_matrix_<host>.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time, run nothing")
    ap.add_argument("--logs", default=None, help="directory for the processes' logs")
    args = ap.parse_args()
    if args.write_slices is not None:
        written = write_slices(args.trace_dir, args.write_slices, args.slice_rows)
        print(json.dumps({"slices": [str(p) for p in written], "rows": args.slice_rows}))
        return
    engines = args.engines.split(",")
    traces = args.traces.split(",")
    try:
        bad = [e for e in engines if e not in ENGINES] or [t for t in traces if t not in TRACE_FILES]
        if bad:
            raise ValueError(f"--engines/--traces: unknown {bad[0]!r} (engines: {','.join(ENGINES)}; traces: "
                             f"{','.join(TRACE_FILES)})")
        if args.device == "cpu" and "vllm" in engines:
            raise ValueError("--engines: vllm runs on GPUs here; use --engines native with --device cpu")
        rates = {t: r for t, r in parse_rates(args.rates, traces).items() if t in traces}
    except ValueError as e:
        sys.exit(f"goodput_matrix: {e}")
    gpu = None
    if args.device == "cuda" and not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            sys.exit("goodput_matrix: no GPU visible (use --device cpu --shape tiny for a dry run)")
        visible = torch.cuda.device_count()
        gpu = torch.cuda.get_device_name(0)
        args.gpus = args.gpus or (visible if visible in PLANS else None)
        if args.gpus is None or args.gpus > visible:
            sys.exit(f"goodput_matrix: --gpus {args.gpus or '?'}: {visible} GPU(s) visible (plans: 1, 2 or 4)")
    args.gpus = args.gpus or 2
    try:
        configs = configs_for(args.gpus, args.configs)
    except ValueError as e:
        sys.exit(f"goodput_matrix: {e}")
    estimate = plan_seconds(args, engines, configs, rates)
    plan = {"gpus": args.gpus, "engines": engines, "configs": configs,
            "rates_rps": {t: [r * args.gpus for r in v] for t, v in rates.items()}, "estimated_s": round(estimate)}
    if args.dry_run:
        print(json.dumps(plan))
        return
    problem = check_trace_rows(args.trace_dir, rates, max(args.duration, args.warmup_duration), args.gpus)
    if problem:
        sys.exit(f"goodput_matrix: {problem}")
    print(f"[plan] {plan}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="splitserve-goodput-matrix-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.shape, Path(tempfile.mkdtemp(prefix="splitserve-model-")))
    name = f"goodput_matrix_{host_tag(args, gpu)}.json"
    meta = {"gpu": gpu, "shape": args.shape, "device": args.device,
            "slo": {"ttft_s": args.slo_ttft, "itl_p99_s": args.slo_itl},
            "settings": {k: getattr(args, k) for k in ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory",
                                                       "max_prefill_tokens_while_decoding", "disagg_threshold",
                                                       "duration", "warmup_duration", "request_timeout",
                                                       "max_input_len", "max_output_len", "spill_backlog")}}
    matrix = Matrix(name, args.out, meta)
    deadline = t0 + args.budget_s
    for engine in engines:
        for config in configs:
            run_cluster(args, model, logs, engine, config, args.gpus, rates, matrix, deadline)
    matrix.doc["last_invocation_s"] = round(time.monotonic() - t0, 1)
    matrix.save()
    print(table(matrix.doc))
    print(json.dumps({"file": str(matrix.path), "rows": matrix.doc["rows"]}))


if __name__ == "__main__":
    main()
