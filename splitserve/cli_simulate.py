"""`splitserve simulate`: replay a request trace through the simulated cluster under a scaling policy (ours, the
oracle, the best static P:D, or an anchor's law) and report SLO attainment and GPU-seconds against the oracle;
`--calibrate` measures our engine's step times on this machine and writes the fitted CPU profile.

The simulation itself is `splitserve.autoscaler.sim` (no engine, no torch); only `--calibrate` loads the engine.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click

from splitserve.autoscaler.profile import PROFILE_DIR
from splitserve.cli_options import config_command, flag
from splitserve.common.config import ClusterResource

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = PROFILE_DIR / "h200_8b.json"
DEFAULT_CPU_PROFILE = PROFILE_DIR / "cpu2_smollm2.json"

SIM_FLAGS = [
    flag("slo-ttft", "slo.ttft_seconds"),
    flag("slo-itl", "slo.itl_seconds"),
    flag("interval", "autoscaling.interval_seconds"),
    flag("scale-up-cooldown", "autoscaling.scale_up_cooldown_seconds"),
    flag("scale-down-cooldown", "autoscaling.scale_down_cooldown_seconds"),
    flag("model-load-seconds", "autoscaling.cold_start_seconds"),
    flag("flips", "autoscaling.role_flips"),
    flag("flip-seconds", "autoscaling.flip_seconds"),
    flag("warm-replicas", "autoscaling.warm_replicas"),
    flag("warm-prefill-replicas", "autoscaling.warm_prefill_replicas"),
    flag("warm-decode-replicas", "autoscaling.warm_decode_replicas"),
    flag("bursts", "autoscaling.bursts"),
    flag("target-utilization", "autoscaling.target_utilization"),
    flag("routing", "router.policy"),
    flag("disagg-threshold", "decode.disagg_threshold"),
    flag("spill-backlog", "router.spill.prefill_backlog_tokens"),
    flag("tensor-parallel-size", "model.tensor_parallel_size"),
]


def _fail(message: str) -> None:
    click.echo(f"splitserve: error: {message}", err=True)
    sys.exit(2)


@click.command("simulate")
@click.option("--trace", "trace_path", default=None, help="a Mooncake .jsonl or Azure .csv trace")
@click.option("--poisson-rate", type=float, default=None, help="instead of a trace: Poisson arrivals, requests/s")
@click.option("--num-requests", type=int, default=1000, show_default=True, help="requests (Poisson mode)")
@click.option("--input-len", type=int, default=1024, show_default=True, help="prompt tokens (Poisson mode)")
@click.option("--output-len", type=int, default=128, show_default=True, help="output tokens (Poisson mode)")
@click.option("--gpus", type=int, default=None, help="GPU budget; also each role's maxReplicas (GPUs / TP)")
@click.option("--policy", type=click.Choice(["slo", "oracle", "static", "ray", "wva", "dynamo", "all"]),
              default="slo", show_default=True, help="who sets the replicas")
@click.option("--profile", "profile_path", default=None,
              help=f"replica profile JSON [default: {DEFAULT_PROFILE.name}]")
@click.option("--time-scale", type=float, default=1.0, show_default=True, help="multiply arrival times by this")
@click.option("--rate-scale", type=float, default=1.0, show_default=True,
              help="replay each request this many times on average (more load, same duration)")
@click.option("--start", type=float, default=0.0, show_default=True, help="trace seconds to skip")
@click.option("--duration", type=float, default=None, help="trace seconds to replay (default: all)")
@click.option("--max-input-len", type=int, default=131072, show_default=True, help="clip prompt lengths")
@click.option("--max-output-len", type=int, default=4096, show_default=True, help="clip output lengths")
@click.option("--target", type=float, default=0.95, show_default=True,
              help="SLO attainment the oracle and the best static P:D must reach")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="end with one JSON line")
@click.option("--plot", "plot_path", default=None, help="write replica, ratio and GPU timelines to this PNG")
@click.option("--calibrate", is_flag=True, help="measure the engine's step times here, fit and write a CPU profile")
@click.option("--out", "out_path", default=None, help=f"--calibrate: where [default: {DEFAULT_CPU_PROFILE.name}]")
@config_command(SIM_FLAGS, file_option="--file")
def simulate(resource: ClusterResource, trace_path: str | None, poisson_rate: float | None, num_requests: int,
             input_len: int, output_len: int, gpus: int | None, policy: str, profile_path: str | None,
             time_scale: float, rate_scale: float, start: float, duration: float | None, max_input_len: int,
             max_output_len: int, target: float, seed: int, as_json: bool, plot_path: str | None, calibrate: bool,
             out_path: str | None) -> None:
    """Simulate a cluster under a scaling policy on a trace; report SLO attainment and GPU-seconds."""
    from splitserve.common.logs import setup_logging

    setup_logging("warning")
    if calibrate:
        out = Path(out_path) if out_path else DEFAULT_CPU_PROFILE
        result = calibrate_cpu(resource, out)
        print(json.dumps(result))
        return
    from splitserve.autoscaler.profile import ReplicaProfile
    from splitserve.autoscaler.sim import report, trace
    from splitserve.autoscaler.sim.experiment import POLICIES, Experiment

    if (trace_path is None) == (poisson_rate is None):
        _fail("give one of --trace FILE or --poisson-rate R")
    if plot_path:
        try:
            report.require_matplotlib()
        except RuntimeError as e:
            _fail(str(e))
    try:
        profile = ReplicaProfile.load(profile_path or DEFAULT_PROFILE)
    except (OSError, ValueError, KeyError, TypeError) as e:
        _fail(f"cannot read the profile: {e}")
    try:
        if trace_path:
            rows = trace.read_trace(trace_path, max_input_len, max_output_len)
            requests = trace.scale(rows, time_scale, rate_scale, start, duration, seed)
        else:
            assert poisson_rate is not None
            requests = trace.poisson(num_requests, poisson_rate, input_len, output_len, seed)
    except (OSError, ValueError, KeyError) as e:
        _fail(f"cannot load the trace: {e}")
    spec = resource.spec.model_copy(deep=True)
    spec.autoscaling.mode = "slo"
    if gpus is not None:
        per_role = max(1, gpus // spec.model.tensor_parallel_size)
        spec.autoscaling.gpu_budget = gpus
        for role in (spec.prefill, spec.decode):
            role.max_replicas = per_role
    exp = Experiment(requests, spec, profile, target=target)
    names = [p for p in POLICIES if p != "oracle"] + ["oracle"] if policy == "all" else [policy]
    rows_out: list[dict[str, Any]] = []
    runs = {}
    for name in names:
        t0 = time.perf_counter()
        summary, res = exp.run(name)
        summary["wall_s"] = round(time.perf_counter() - t0, 2)
        rows_out.append(summary)
        if res is not None:
            runs[name] = res
    click.echo(f"{len(requests)} requests over {requests[-1].arrival:.0f} s; profile {profile.name}; "
               f"SLO TTFT {spec.slo.ttft_seconds:g} s, ITL {spec.slo.itl_seconds * 1e3:g} ms; "
               f"start {exp.initial()}")
    click.echo(report.table(rows_out))
    if plot_path:
        report.plot(runs, exp.oracle(), plot_path, title=Path(trace_path or "poisson").name)
    if as_json:
        last = dict(rows_out[0]) if len(rows_out) == 1 else {"policies": rows_out}
        if len(rows_out) > 1:
            first = rows_out[0]
            last |= {k: first[k] for k in ("requests", "slo_attainment", "gpu_seconds", "oracle_gpu_seconds")}
        last["trace"] = trace_path
        print(json.dumps(last))


# -- calibration: our engine's step times on this machine ---------------------------------------------------
def calibrate_cpu(resource: ClusterResource, out: Path, reps: int = 3) -> dict[str, Any]:
    """Measure SmolLM2 (or the configured model) step times on this CPU with a decode worker's settings,
    fit the step cost, and write the profile. Prints a table; returns the JSON summary."""
    import torch

    from splitserve.autoscaler.profile import ReplicaProfile
    from splitserve.autoscaler.sim.calibrate import StepPoint, fit_errors, fit_points, kv_case
    from splitserve.common.proc import usable_cores
    from splitserve.common.sampling import SamplingParams
    from splitserve.engine.config import engine_config
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model_files import prepare_model

    spec = resource.spec
    threads = spec.decode.engine.threads or max(1, usable_cores() // 2)  # `up`: cores / workers
    torch.set_num_threads(threads)
    prepare_model(spec.model.name)
    t0 = time.perf_counter()
    engine = LLMEngine(engine_config(spec.model, spec.decode.engine))
    load_s = time.perf_counter() - t0
    vocab = engine.arch.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(1000, min(30000, vocab), (n,), generator=g).tolist()

    points: list[StepPoint] = []
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([prompt(64)], greedy)  # warm-up
    for n in (32, 128, 384, 768):  # prefill: one prompt, one step
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            engine.generate([prompt(n)], greedy)
            ts.append(time.perf_counter() - t)
        points.append(StepPoint.prefill(n, statistics.median(ts)))
        click.echo(f"prefill {n:5d} tokens: {points[-1].seconds * 1e3:8.1f} ms", err=True)
    for batch, ctx in ((1, 128), (4, 128), (8, 256), (16, 128), (32, 64), (4, 512)):  # decode
        for i in range(batch):
            engine.add_request(f"d{batch}-{ctx}-{i}", prompt(ctx),
                               SamplingParams(max_tokens=reps + 4, temperature=0.0, ignore_eos=True))
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
            engine.step()
        engine.step()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            engine.step()
            ts.append(time.perf_counter() - t)
        for r in list(engine.scheduler.running):
            engine.abort_request(r.request_id)
        points.append(StepPoint.decode(batch, ctx + 2, statistics.median(ts)))
        click.echo(f"decode batch {batch:3d} ctx {ctx:5d}: {points[-1].seconds * 1e3:8.1f} ms", err=True)
    cost = fit_points(points)
    errors = fit_errors(cost, points)
    nixl = _has_nixl()
    results = ROOT / "benchmarks" / "results"
    case = kv_case(results / ("kv_transfer_nixl_cpu.txt" if nixl else "kv_transfer_tcp_cpu.txt"), "smollm2_2k")
    ks = engine.kv_spec
    profile = ReplicaProfile(
        name=f"{spec.model.name}-cpu{os.cpu_count()}", cost=cost,
        kv_capacity_tokens=ks.num_blocks * ks.block_size,
        kv_bytes_per_token=2 * engine.arch.num_layers * ks.num_kv_heads * ks.head_dim * engine.dtype.itemsize,
        max_num_seqs=spec.decode.engine.max_num_seqs, max_num_batched_tokens=spec.decode.engine.max_num_batched_tokens,
        kv_transfer_gbps=case["layerwise_gbps"], kv_transfer_tail_s=case["tail_after_last_layer_ms"] / 1e3,
        cold_start_seconds={"native": round(load_s, 2)},
        source={"fit": "least squares over measured steps (relative error), knee on a grid", "threads": threads,
                "kv_case": f"{'nixl' if nixl else 'tcp'} smollm2_2k", "errors": errors,
                "loadavg": list(os.getloadavg()), "cold_start_note": "native: engine construction only (no process start)"})
    profile.save(out)
    worst = max(abs(e["error"]) for e in errors)
    click.echo(f"fitted {cost}; worst step error {worst:.1%}; wrote {out}", err=True)
    return {"profile": str(out), "points": len(points), "max_abs_error": round(worst, 4),
            "mean_abs_error": round(sum(abs(e["error"]) for e in errors) / len(errors), 4),
            "cold_start_seconds": profile.cold_start_seconds, "threads": threads}


def _has_nixl() -> bool:
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True
