"""engine vllm against engine native on ONE GPU, through our gateway: 1P+1D (two workers sharing the GPU) and
colocated, each engine with the same random-weight model shape, the same flags and the same requests.

What it measures (`benchmarks/serving_gpu.py`'s orchestration and its `handover` part: one request at a time on
an idle cluster, fresh prompts of --handover-len tokens, --handover-output new tokens):
  ttft_ms, itl_ms     medians, per engine and mode
  stages_ms           1P+1D: the decode worker's handover stages (means); after the prefill's reply, vLLM's
                      `first_token` holds the decode server's pull and first step, native's the first token out
  pd_tail_ms          TTFT(1P+1D) - TTFT(colocated): what handing the KV over adds to the first token. For
                      vLLM the decode server pulls the whole prompt's KV after the prefill ended (NixlConnector);
                      for native the prefill worker streams it layer by layer while computing.
  vllm_nixl           the decode server's own NIXL counters (`vllm:nixl_xfer_time_seconds`, bytes), when exposed
and a Poisson load (--requests at --rate/s, --input-len/--output-len) per engine in 1P+1D: TTFT/ITL p50/p99.

The two workers of 1P+1D share GPU 0, so each gets --kv-cache-memory (bytes: the same KV for both engines);
with --gpus 2 the prefill worker has GPU 0 and the decode worker GPU 1 (colocated stays on GPU 0), and --trace
replays a shared trace at each --trace-rates rate against each engine's 1P+1D: goodput (requests/s meeting both
SLOs) per GPU.
Needs vLLM importable by `python3` (engine vllm starts `python3 -m vllm.entrypoints.openai.api_server`).
Prints a table, then the JSON line; --out writes it.

--connectors layerwise,push,pull compares engine vllm's KV connectors (`vllm.connector`) on the same host instead,
with the same model shape, flags and requests: a colocated server, then 1P+1D with each connector, per --layouts
(`two`: prefill on GPU 0, decode on GPU 1; `one`: both servers on GPU 0). Per connector:
  pd_tail_ms          TTFT(1P+1D) - TTFT(colocated) across two GPUs: medians over --handover-requests (>= 24)
                      one at a time, --handover-len-token prompts
  decode_step_ms      the 1P+1D decode step at batch 1 (inter-token latency)
  one_gpu_pd_tail_ms  the same tail with both servers on one GPU (and one_gpu_decode_step_ms)
  goodput_per_gpu     with --trace, 1P+1D across two GPUs at each --trace-rates rate (azure_code at 6 req/s:
                      `--trace azure_code --trace-rates 6`)
and writes benchmarks/results/vllm_connectors_<--tag>.json (a table, then the JSON line). The one-GPU part alone
fits one H200 in under 10 minutes:
  python3 benchmarks/serving_vllm_gpu.py --connectors layerwise,push,pull --layouts one --requests 0 --tag h200_one_gpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harness import SHAPES, TRACE_FILES, TRACES, handover, model_dir, stage_means_ms
from harness import PlacedCluster as Cluster
from harness import replay_at_rate as bench


def vllm_server_url(worker_pid: int) -> str | None:
    """The HTTP URL of the vLLM server a worker started (the --port of its child, the shim that runs the server
    with the server's command line after its own)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            args = (proc / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == worker_pid and "vllm.entrypoints.openai.api_server" in args:
            return f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    return None


def nixl_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:nixl_[a-z_]+?)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def poisson(url: str, args) -> dict:
    cmd = [str(Path(sys.executable).parent / "splitserve"), "bench", "--url", url, "--model", args.shape,
           "--rate", str(args.rate), "--num-requests", str(args.requests), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--vocab-low", "1", "--vocab-high",
           str(SHAPES[args.shape]["vocab_size"]), "--seed", "3", "--json", "--no-progress", "--timeout", "300"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"bench failed: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: res.get(k) for k in ("completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                                   "output_tok_s")}


def goodput(url: str, args, rate: float) -> dict:
    try:
        r = bench(args, url, args.trace, rate)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"[{args.trace} @{rate}] failed: {e}", file=sys.stderr, flush=True)
        return {"offered_rps": rate, "error": str(e)[-500:]}
    gpus = 2 if args.gpus >= 2 else 1
    out = {k: r.get(k) for k in ("offered_rps", "goodput_rps", "completed", "failed", "ttft_p50_s", "ttft_p99_s",
                                 "itl_p50_s", "itl_p99_s")}
    out["goodput_per_gpu"] = round(r["goodput_rps"] / gpus, 4)
    print(f"[{args.trace} @{rate}] {out}", file=sys.stderr, flush=True)
    return out


def run_engine(engine: str, args, model: Path, logs: Path) -> dict:
    extra = ["--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if engine == "vllm":  # two servers on one GPU: each may hold this share of it (weights + KV + activations)
        share = args.vllm_gpu_share if args.gpus < 2 else 0.85
        extra += ["--engine", "vllm", "--vllm-args", f"--gpu-memory-utilization,{share}"]
    res: dict = {}
    decode_gpu = 1 if args.gpus >= 2 else 0
    for mode, workers in (("colocated", [("both", [0], extra)]),
                          ("disaggregated", [("prefill", [0], extra), ("decode", [decode_gpu], extra)])):
        if mode not in args.modes.split(","):
            continue
        key = f"{engine}_{mode}"
        t0 = time.monotonic()
        try:
            with Cluster(args, model, mode, workers, logs, key) as c:
                ready = time.monotonic() - t0
                vllm_url = vllm_server_url(c.procs[-2 if mode == "disaggregated" else 0][1].pid) \
                    if engine == "vllm" else None
                before = nixl_counters(vllm_url) if vllm_url and mode == "disaggregated" else {}
                stages_before = c.stage_totals() if mode == "disaggregated" else {}
                h = handover(c.url, args)
                entry = {"ready_s": round(ready, 1), "ttft_ms": round(h["ttft_ms"], 2),
                         "itl_ms": round(h["itl_ms"], 3)}
                if mode == "disaggregated":
                    entry["counters"] = c.counters()
                    # the decode worker's handover stages: for vLLM, `first_token` is its decode server's pull of
                    # the prompt's KV and first step after the prefill replied; for native, the KV already landed
                    entry["stages_ms"] = stage_means_ms(stages_before, c.stage_totals(),
                                                        early=None if engine == "native" else False)
                    if vllm_url:
                        after = nixl_counters(vllm_url)
                        entry["vllm_nixl"] = {k: round(after[k] - before.get(k, 0.0), 6) for k in after}
                    if args.requests:
                        entry["load"] = poisson(c.url, args)
                    if args.trace:
                        entry["goodput"] = [goodput(c.url, args, rate) for rate in args.trace_rates]
                res[mode] = entry
        except (RuntimeError, TimeoutError) as e:
            res[mode] = {"error": str(e)[-1500:]}
        print(f"[{key}] {res[mode]}", file=sys.stderr, flush=True)
    if "ttft_ms" in res.get("colocated", {}) and "ttft_ms" in res.get("disaggregated", {}):
        res["pd_tail_ms"] = round(res["disaggregated"]["ttft_ms"] - res["colocated"]["ttft_ms"], 2)
    return res


def run_connector_cluster(args, model: Path, logs: Path, key: str, mode: str, decode_gpu: int, connector: str,
                          share: float) -> dict:
    """One engine vllm cluster (colocated, or 1P+1D with `connector`): ready time, the handover's TTFT and decode
    step medians, its stages, and (1P+1D on two GPUs, with --trace) goodput."""
    extra = ["--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--engine", "vllm",
             "--vllm-args", f"--gpu-memory-utilization,{share}"]
    if mode == "disaggregated":
        extra += ["--vllm-connector", connector, "--transfer-timeout", "60"]
        workers = [("prefill", [0], extra), ("decode", [decode_gpu], extra)]
    else:
        workers = [("both", [0], extra)]
    t0 = time.monotonic()
    try:
        with Cluster(args, model, mode, workers, logs, key) as c:
            entry: dict = {"ready_s": round(time.monotonic() - t0, 1)}
            stages_before = c.stage_totals() if mode == "disaggregated" else {}
            h = handover(c.url, args)
            entry.update(ttft_ms=round(h["ttft_ms"], 2), itl_ms=round(h["itl_ms"], 3), ttft_all_ms=h["ttft_all_ms"])
            if mode == "disaggregated":
                entry["counters"] = c.counters()
                entry["stages_ms"] = stage_means_ms(stages_before, c.stage_totals(), early=connector == "layerwise")
                entry["kv_transports"] = _transports(c.url)
                if args.trace and decode_gpu != 0:
                    entry["goodput"] = [goodput(c.url, args, rate) for rate in args.trace_rates]
    except (RuntimeError, TimeoutError) as e:
        entry = {"error": str(e)[-1500:]}
    print(f"[{key}] {entry}", file=sys.stderr, flush=True)
    return entry


def _transports(url: str) -> dict:
    """What /health says each worker's NIXL agent uses toward its peers."""
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return {w["role"]: w.get("kv_transports") or {} for w in json.loads(r.read())["workers"]}


def compare_connectors(args, model: Path, logs: Path) -> dict:
    """--connectors: a colocated baseline and 1P+1D per connector, for each layout (see the module's docstring)."""
    connectors = args.connectors.split(",")
    out: dict = {"connectors": connectors, "shape": args.shape, "workload": {
        "handover_len": args.handover_len, "handover_requests": args.handover_requests,
        "handover_output": args.handover_output, "kv_cache_memory": args.kv_cache_memory,
        "trace": args.trace or None, "trace_rates": args.trace_rates if args.trace else None},
        "layouts": args.layouts.split(","), "runs": {}, "logs": str(logs)}
    per: dict = {c: {} for c in connectors}
    for layout in out["layouts"]:
        two = layout == "two"
        args.gpus = 2 if two else 1  # goodput is per GPU used
        share = 0.85 if two else args.vllm_gpu_share  # one GPU: the two servers share it
        prefix = "" if two else "one_gpu_"
        colo = run_connector_cluster(args, model, logs, f"colocated_{layout}", "colocated", 0, "", share)
        out["runs"][f"colocated_{layout}"] = colo
        for c in connectors:
            key = f"{c}_{layout}"
            dis = run_connector_cluster(args, model, logs, key, "disaggregated", 1 if two else 0, c, share)
            out["runs"][key] = dis
            if "ttft_ms" in dis and "ttft_ms" in colo:
                per[c][f"{prefix}pd_tail_ms"] = round(dis["ttft_ms"] - colo["ttft_ms"], 2)
                per[c][f"{prefix}decode_step_ms"] = dis["itl_ms"]
                per[c][f"{prefix}colocated_decode_step_ms"] = colo["itl_ms"]
            elif "error" in dis:
                per[c][f"{prefix}error"] = dis["error"][-300:]
            for g in dis.get("goodput", []):
                per[c].setdefault("goodput_per_gpu", {})[str(g["offered_rps"])] = g.get("goodput_per_gpu")
    out["per_connector"] = per
    return out


def connectors_table(out: dict) -> str:
    rows = ["| connector | pd_tail_ms (2 GPUs) | decode_step_ms | one_gpu_pd_tail_ms | one_gpu_decode_step_ms | "
            "goodput/GPU |", "|" + " --- |" * 6]
    for c, r in out["per_connector"].items():
        rows.append(f"| {c} | {r.get('pd_tail_ms', '-')} | {r.get('decode_step_ms', '-')} | "
                    f"{r.get('one_gpu_pd_tail_ms', '-')} | {r.get('one_gpu_decode_step_ms', '-')} | "
                    f"{r.get('goodput_per_gpu', '-')} |")
    return "\n".join(rows)


def table(out: dict) -> str:
    rows = ["| engine | mode | ready s | TTFT ms (1 req) | ITL ms (1 req) | load TTFT p50 s | load ITL p50 s | "
            "load tok/s |", "|" + " --- |" * 8]
    for engine in out["engines"]:
        r = out[engine]
        for mode in ("colocated", "disaggregated"):
            e = r.get(mode, {})
            if "error" in e:
                rows.append(f"| {engine} | {mode} | failed: {e['error'][-120:]!r} | | | | | |")
                continue
            load = e.get("load", {})
            rows.append(f"| {engine} | {mode} | {e.get('ready_s')} | {e.get('ttft_ms')} | {e.get('itl_ms')} | "
                        f"{load.get('ttft_p50_s', '-')} | {load.get('itl_p50_s', '-')} | "
                        f"{load.get('output_tok_s', '-')} |")
    tails = ", ".join(f"{e}: {out[e].get('pd_tail_ms', '-')} ms" for e in out["engines"])
    rows += ["", f"TTFT(1P+1D) - TTFT(colocated), {out['workload']['handover_len']}-token prompts: {tails}"]
    for engine in out["engines"]:
        for g in out[engine].get("disaggregated", {}).get("goodput", []):
            rows.append(f"{engine} 1P+1D, {out['workload']['trace']} at {g['offered_rps']} req/s: goodput "
                        f"{g.get('goodput_per_gpu')} req/s/GPU, TTFT p50 {g.get('ttft_p50_s')} s, ITL p50 "
                        f"{g.get('itl_p50_s')} s, failed {g.get('failed', g.get('error'))}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="vllm,native")
    ap.add_argument("--modes", default="colocated,disaggregated",
                    help="which of colocated,disaggregated to run (the P/D tail needs both)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-memory", default="12GiB", help="per worker (two share the GPU in 1P+1D)")
    ap.add_argument("--kv-transport", default="auto")
    ap.add_argument("--vllm-gpu-share", type=float, default=0.45,
                    help="engine vllm: --gpu-memory-utilization of each server (two share the GPU)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--disagg-threshold", type=int, default=512)
    ap.add_argument("--handover-len", type=int, default=3072)
    ap.add_argument("--handover-output", type=int, default=32)
    ap.add_argument("--handover-requests", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64, help="Poisson load requests in 1P+1D (0: no load run)")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--gpus", type=int, default=1, choices=[1, 2], help="2: the 1P+1D workers on GPUs 0 and 1")
    ap.add_argument("--trace", default="", choices=["", *sorted(TRACE_FILES)],
                    help="replay this trace against each engine's 1P+1D (goodput per GPU)")
    ap.add_argument("--trace-rates", default="4,8", help="offered requests/s, comma-separated")
    ap.add_argument("--trace-dir", type=Path, default=TRACES)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per trace run")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-itl", type=float, default=0.05)
    ap.add_argument("--max-input-len", type=int, default=7168)
    ap.add_argument("--max-output-len", type=int, default=512)
    ap.add_argument("--out", default="")
    ap.add_argument("--connectors", default="",
                    help="compare these vllm.connector choices (layerwise,push,pull) instead of the engines")
    ap.add_argument("--layouts", default="two,one", help="--connectors: two (GPUs 0 and 1) and/or one (GPU 0 only)")
    ap.add_argument("--tag", default="", help="--connectors: writes benchmarks/results/vllm_connectors_<tag>.json")
    args = ap.parse_args()
    try:
        args.trace_rates = [float(x) for x in args.trace_rates.split(",")]
    except ValueError:
        ap.error(f"--trace-rates: {args.trace_rates!r} is not a comma-separated list of numbers")
    logs = Path(tempfile.mkdtemp(prefix="splitserve-vllm-gpu-"))
    model = model_dir(args.shape, logs)
    if args.connectors:
        bad = set(args.connectors.split(",")) - {"layerwise", "push", "pull"}
        if bad or not set(args.layouts.split(",")) <= {"one", "two"}:
            ap.error(f"--connectors: {sorted(bad)} not among layerwise,push,pull (or --layouts not among one,two)")
        if args.handover_requests < 24:
            args.handover_requests = 24  # medians of at least 24
        out = compare_connectors(args, model, logs)
        try:
            import torch

            out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        except ImportError:
            out["device"] = "unknown"
        print(connectors_table(out))
        path = Path(args.out) if args.out else \
            Path(__file__).resolve().parent / "results" / f"vllm_connectors_{args.tag or 'run'}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out))
        sys.stdout.flush()
        os._exit(0)
    out: dict = {"engines": args.engines.split(","), "shape": args.shape, "workload": {
        "handover_len": args.handover_len, "handover_output": args.handover_output,
        "requests": args.requests, "rate": args.rate, "input_len": args.input_len, "output_len": args.output_len,
        "kv_cache_memory": args.kv_cache_memory, "gpus": args.gpus, "trace": args.trace or None,
        "trace_rates": args.trace_rates if args.trace else None}, "logs": str(logs)}
    try:
        import torch

        out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        out["device"] = "unknown"
    for engine in out["engines"]:
        out[engine] = run_engine(engine, args, model, logs)
    if all("ttft_ms" in out[e].get("disaggregated", {}) for e in out["engines"]):
        out["itl_ms_median"] = {e: out[e]["disaggregated"]["itl_ms"] for e in out["engines"]}
    text = table(out)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # leave no worker thread holding the interpreter


if __name__ == "__main__":
    main()
