"""Disaggregated against colocated serving on the GPUs of one host, end to end: the gateway and the workers as
real processes (random weights of a real model's shape, `--load-format dummy`), driven by `splitserve bench`.

Parts (--parts):
  transfer  layer-wise KV transfer of an 8B-shaped 3k-token prompt between two GPUs (NIXL) against a torch
            peer copy measured in the same run (`benchmarks/kv_transfer.py`): transfer_gbps, p2p_copy_gbps
  handover  on an idle system, TTFT(disaggregated 1P+1D) - TTFT(colocated) for --handover-len-token prompts,
            one at a time, and the decode step (inter-token latency at batch 1): handover_ms, decode_step_ms;
            where the disaggregated time goes, as the workers' stage histograms' means over the same requests
            (splitserve_handover_stage_seconds, splitserve_prefill_stage_seconds): handover_stages_ms
  goodput   per-GPU goodput (requests/s meeting --slo-ttft and --slo-itl, over the GPUs used) of each
            configuration's disaggregated and colocated clusters on two trace slices replayed at a fixed rate:
            Azure conversation (azure_conv) and Azure code, the prefill-heavy one (azure_code)
  burst     prefill throughput through the serving stack: prompts sent at once to 1P+1D and to one colocated
            worker with the prefill worker's chunk budget, against the engine's own prefill rate
  moe       an MoE shape (Qwen3-30B-A3B): prefill TP=1 streaming into decode TP=2 with expert parallelism,
            decode tokens/s at batch --moe-batch, against a colocated TP=2 EP worker (the same requests).
            3 GPUs (prefill on 0, decode on 1-2), or 2 with --moe-share-gpu (prefill and decode rank 0 share
            GPU 0, with explicit KV sizes: --moe-prefill-kv-cache-memory, --moe-decode-kv-cache-memory)
Configurations (--configs): 1p1d (2 GPUs; against 2 colocated), 1p3d and 2p2d (4 GPUs; against 4 colocated).

The model's tokenizer is a synthetic word-level one with the model's vocabulary size (every id decodes to a
visible token), so any shape can be served with no files but its config. Writes
benchmarks/results/serving_gpu_<tag>.json (--out; --update merges into an existing file) and prints a table,
then the JSON line. `--device cpu --shape tiny` runs the same orchestration on the CPU with a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from splitserve.common.proc import free_port

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
TRACE_FILES = {"azure_conv": "azure_conv_2023.csv", "azure_code": "azure_code_2023.csv"}

SHAPES = {
    "llama8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                "max_position_embeddings": 131072, "tie_word_embeddings": False, "eos_token_id": 128001,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen3_30b_a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                      "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                      "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "eos_token_id": 151645},
    # engine vllm's CPU dry run (vLLM's CPU attention takes head_dim 64 but not 16)
    "tiny_llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
                   "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 0},
    # the CPU dry run: small enough for a 2-core machine, with 2 KV heads so TP=2 splits them
    "tiny": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
             "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
             "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 4096, "tie_word_embeddings": False, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "eos_token_id": 0},
}
CONFIGS = {"1p1d": (1, 1), "1p3d": (1, 3), "2p2d": (2, 2)}  # (prefill workers, decode workers), one GPU each
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTHONUNBUFFERED": "1"}
START_S = 900.0  # seconds for a cluster to become ready (imports, dummy weights, CUDA graphs)
# the handover's stage histograms, per worker role (docs/architecture.md, "The handover, stage by stage")
STAGE_METRICS = {"decode": "splitserve_handover_stage_seconds", "prefill": "splitserve_prefill_stage_seconds"}


def model_dir(shape: str, root: Path) -> Path:
    """config.json of the shape and a word-level tokenizer of its vocabulary size."""
    d = root / shape
    d.mkdir(parents=True, exist_ok=True)
    cfg = SHAPES[shape]
    (d / "config.json").write_text(json.dumps(cfg))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
           "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{cfg['eos_token_id']}"}))
    return d


class Cluster:
    """A gateway and workers as processes. `workers`: (role, GPU ids, extra flags) per worker."""

    def __init__(self, args, model: Path, mode: str, workers: list[tuple[str, list[int], list[str]]],
                 log_dir: Path, name: str) -> None:
        self.args, self.model, self.mode, self.name = args, model, mode, name
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        exe = str(Path(sys.executable).parent / "splitserve")
        common = ["--model", str(model), "--served-model-name", args.shape, "--max-model-len", str(args.max_model_len)]
        planned = [(role, gpus, extra, free_port(), free_port()) for role, gpus, extra in workers]
        prefill = [f"127.0.0.1:{p}" for role, _, _, p, _ in planned if role == "prefill"]
        self.metrics_urls = [f"http://127.0.0.1:{m}" for role, _, _, _, m in planned if role != "prefill"]
        self.prefill_metrics_urls = [f"http://127.0.0.1:{m}" for role, _, _, _, m in planned if role == "prefill"]
        decode = [f"127.0.0.1:{p}" for role, _, _, p, _ in planned if role != "prefill"]
        for i, (role, gpus, extra, port, mport) in enumerate(planned):
            cmd = [exe, "worker", "--role", role, *common, "--load-format", "dummy", "--device", args.device,
                   "--port", str(port), "--metrics-port", str(mport), "--kv-transport", args.kv_transport,
                   "--tensor-parallel-size", str(max(1, len(gpus))), *extra]
            if role == "decode":
                cmd += ["--prefill-peers", ",".join(prefill), "--disagg-threshold", str(args.disagg_threshold)]
            env = dict(os.environ, **CHILD_ENV)
            if args.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            self._spawn(f"{role}-{i}", cmd, env)
        self._spawn("router", [exe, "router", *common, "--mode", mode, "--port", str(self.port),
                               "--decode", ",".join(decode), "--prefill", ",".join(prefill)] +
                    (["--max-inflight", "1024"]), dict(os.environ, **CHILD_ENV))

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        log = open(self.log_dir / f"{self.name}-{name}.log", "w")
        self.procs.append((name, subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                                  start_new_session=True)))

    def wait_ready(self) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_S:
            for name, p in self.procs:
                if p.poll() is not None:
                    tail = (self.log_dir / f"{self.name}-{name}.log").read_text()[-3000:]
                    raise RuntimeError(f"{self.name}: {name} exited with {p.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("all_healthy"):
                        return time.monotonic() - t0
            except (OSError, ValueError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name}: not ready in {START_S:.0f} s")

    def counters(self) -> dict[str, float]:
        """Where the decode workers' prompts were prefilled: remote (ok / failed) and local (by reason)."""
        return _scrape(self.metrics_urls, ("splitserve_remote_prefill_total", "splitserve_local_prefill_total"))

    def stage_totals(self) -> dict[str, float]:
        """The handover's stage histograms' counts and sums, decode and prefill workers summed."""
        return _scrape(self.metrics_urls + self.prefill_metrics_urls,
                       tuple(f"{name}_{part}" for name in STAGE_METRICS.values() for part in ("count", "sum")))

    def kv_transports(self) -> list[str]:
        """What each worker's KV agent chose ("kv transport: nixl ..." in its log): auto falls back to tcp."""
        found = []
        for name, _ in self.procs:
            for line in (self.log_dir / f"{self.name}-{name}.log").read_text(errors="replace").splitlines():
                if "kv transport:" in line:
                    chosen = line.split("kv transport:", 1)[1].strip().rstrip('"}')  # the log line is JSON
                    found.append(f"{name}: {chosen}")
                    break
        return found

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    def __enter__(self) -> Cluster:
        try:
            ready_s = self.wait_ready()
        except BaseException:
            self.stop()
            raise
        print(f"[{self.name}] ready in {ready_s:.0f} s", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _scrape(urls: list[str], prefixes: tuple[str, ...]) -> dict[str, float]:
    """The samples of /metrics whose name starts with one of `prefixes`, {'name{labels}': value} summed over
    `urls`."""
    out: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(prefixes):
                    key, _, value = line.rpartition(" ")
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def stage_means_ms(before: dict[str, float], after: dict[str, float], early: bool | None = None) -> dict:
    """Mean milliseconds per stage between two `Cluster.stage_totals`, per role, in the workers' stage order;
    `rpc_hops`: the prefill call's span on the decode worker less the prefill worker's stages (the gRPC round
    trip). The span is its `prefill` stage, and with `early` (the call out before the reservation, the default
    unless SPLITSERVE_PREFILL_EARLY=0) its `reserve` and `ticket` stages too."""
    if early is None:
        early = os.environ.get("SPLITSERVE_PREFILL_EARLY", "1") != "0"
    out: dict = {}
    for role, name in STAGE_METRICS.items():
        stages = {}
        for key, count in after.items():
            if key.startswith(f"{name}_count{{"):
                stage = key.split('stage="', 1)[1].split('"', 1)[0]
                n = count - before.get(key, 0.0)
                total = after[key.replace("_count{", "_sum{")] - before.get(key.replace("_count{", "_sum{"), 0.0)
                stages[stage] = round(1e3 * total / n, 3) if n else None
        out[role] = stages
    dec, pre = out["decode"], out["prefill"]
    firsts = f'{STAGE_METRICS["decode"]}_count{{stage="first_token"}}'
    out["requests"] = int(after.get(firsts, 0.0) - before.get(firsts, 0.0))
    if dec.get("prefill") is not None and pre and None not in pre.values():
        span = dec["prefill"] + (dec["reserve"] + dec["ticket"] if early else 0.0)
        out["rpc_hops"] = round(span - sum(pre.values()), 3)
    return out


def worker_args(args, role: str) -> list[str]:
    """Engine flags per role: the colocated baseline keeps ITL low with a small chunk budget; a prefill worker
    takes big chunks; a decode worker only decodes."""
    budget = {"prefill": args.prefill_budget, "decode": args.decode_budget, "both": args.colocated_budget}[role]
    return ["--max-num-batched-tokens", str(budget), "--max-num-seqs", str(args.max_num_seqs),
            "--kv-cache-memory", args.kv_cache_memory]


def gpu_groups(n: int, per: int = 1) -> list[list[int]]:
    return [list(range(i * per, (i + 1) * per)) for i in range(n)]


# -- parts ---------------------------------------------------------------------------------------------------
def part_transfer(args) -> dict:
    backend = args.kv_transport if args.kv_transport != "auto" else ("nixl" if args.device == "cuda" else "tcp")
    cases = "llama8b_3k,one_layer_403mb" if args.device == "cuda" else "smollm2_2k"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kv_transfer.py"), "--backend", backend,
           "--device", args.device, "--cases", cases, "--reps", str(args.reps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, **CHILD_ENV))
    sys.stderr.write(out.stdout)
    if out.returncode != 0:
        raise RuntimeError(f"kv_transfer.py failed: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    case = res["cases"][0]
    return {"transfer_gbps": case["layerwise_gbps"], "transfer_whole_gbps": case["whole_gbps"],
            "p2p_copy_gbps": res["copy_gbps"], "transfer_tail_ms": case["tail_after_last_layer_ms"],
            "transfer_layer_ms": case["layer_transfer_ms"], "transfer_cases": res["cases"]}


async def _sequential(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    import httpx

    from splitserve.bench import Job, one

    async with httpx.AsyncClient(timeout=600) as client:
        return [await one(client, url, model, Job(0.0, p, max_tokens)) for p in prompts]


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def handover(url: str, args) -> dict:
    """One request at a time on an idle cluster (fresh prompts: no prefix hits): TTFT and inter-token latency."""
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = _prompts(args.handover_requests, args.handover_len, vocab, 2)
    res = asyncio.run(_sequential(url, args.shape, prompts, args.handover_output))
    ok = [r for r in res if r.ok]
    if not ok:
        raise RuntimeError(f"handover: every request failed: {res[0].error}")
    # the decode step as the client sees it: (last token - first token) / (tokens - 1), per request
    steps = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"ttft_ms": statistics.median(r.ttft for r in ok) * 1e3, "itl_ms": statistics.median(steps) * 1e3,
            "ttft_all_ms": [round(r.ttft * 1e3, 2) for r in ok]}


def _trace_scale(trace_dir: Path, trace: str, n: int, rate: float) -> float:
    """--time-scale that replays the trace's first n requests at `rate` requests/s on average."""
    with open(trace_dir / TRACE_FILES[trace]) as f:
        rows = [float(r["arrived_at"]) for _, r in zip(range(n), csv.DictReader(f), strict=False)]
    span = rows[-1] - rows[0]
    return (n - 1) / rate / span if span > 0 else 1.0


def bench(args, url: str, trace: str, rate: float, seed: int = 0, duration: float | None = None) -> dict:
    """One `splitserve bench` run. `seed` picks the prompts' token ids: each run on a cluster takes its own, so a
    repeated rate meets a cold prefix cache as the first did (every mode runs the same seeds in the same order)."""
    seconds = args.duration if duration is None else duration
    n = max(8, int(rate * seconds))
    cmd = [str(Path(sys.executable).parent / "splitserve"), "bench", "--url", url, "--model", args.shape,
           "--trace", str(args.trace_dir / TRACE_FILES[trace]), "--num-requests", str(n),
           "--time-scale", f"{_trace_scale(args.trace_dir, trace, n, rate):.6f}",
           "--max-input-len", str(args.max_input_len),
           "--max-output-len", str(args.max_output_len), "--slo-ttft", str(args.slo_ttft),
           "--slo-itl", str(args.slo_itl), "--vocab-low", "1", "--vocab-high",
           str(SHAPES[args.shape]["vocab_size"]), "--seed", str(seed), "--json", "--no-progress", "--timeout", "300"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 4 + 600)
    if out.returncode != 0:
        raise RuntimeError(f"bench failed: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["offered_rps"] = rate
    return res


def part_serving(args, model: Path, logs: Path, want_handover: bool, want_goodput: bool) -> dict:
    """For each configuration: its disaggregated cluster and a colocated one on as many GPUs (shared by the
    configurations of one GPU count), each trace at each offered rate; on the first 2-GPU pair, the handover
    (one request at a time, before the load)."""
    out: dict = {"goodput_per_gpu": {}, "goodput_runs": {}}
    rates = {k: [float(x) for x in v.split("/")] for k, v in (kv.split("=") for kv in args.rates.split(","))}
    colocated_done: dict[int, dict] = {}
    traces = args.traces.split(",") if want_goodput else []
    for config in args.configs.split(","):
        n_pre, n_dec = CONFIGS[config]
        gpus = n_pre + n_dec
        disagg = [("prefill", [i], worker_args(args, "prefill")) for i in range(n_pre)] + \
                 [("decode", [n_pre + i], worker_args(args, "decode")) for i in range(n_dec)]
        colocated = [("both", [i], worker_args(args, "both")) for i in range(gpus)]
        key = f"{gpus}gpu_{config}"
        runs: dict = {}
        if traces:
            out["goodput_runs"][key] = runs  # filled in place: the partial file shows each run as it ends
        for mode, workers in (("disagg", disagg), ("colocated", colocated)):
            if mode == "colocated" and gpus in colocated_done:
                runs["colocated"] = colocated_done[gpus]
                continue
            res: dict = {}
            runs[mode] = res
            after_run = functools.partial(_after_run, args, out, key, runs, traces, gpus)
            try:
                _measure_cluster(args, model, logs, key, mode, workers, res,
                                 want_handover and "handover" not in out and gpus == 2,
                                 {t: rates[t] for t in traces}, after_run)
            except (RuntimeError, TimeoutError, OSError) as e:  # a cluster that fails to start or serve
                print(f"[{key} {mode}] failed: {e}", file=sys.stderr, flush=True)
                res["error"] = str(e)[-2000:]
            if mode == "colocated":
                colocated_done[gpus] = res
            save_partial(args, out)
        if "handover" in runs.get("disagg", {}) and "handover" in runs.get("colocated", {}):
            d, c = runs["disagg"].pop("handover"), runs["colocated"].pop("handover")
            out["handover"] = {"prompt_tokens": args.handover_len, "requests": args.handover_requests,
                               "ttft_disagg_ms": d["ttft_ms"], "ttft_colocated_ms": c["ttft_ms"],
                               "itl_disagg_ms": d["itl_ms"], "itl_colocated_ms": c["itl_ms"],
                               "ttft_disagg_all_ms": d["ttft_all_ms"], "ttft_colocated_all_ms": c["ttft_all_ms"],
                               "handover_ms": d["ttft_ms"] - c["ttft_ms"], "decode_step_ms": d["itl_ms"],
                               "stages_ms": d.get("stages_ms")}
        runs.get("colocated", {}).pop("handover", None)
        if traces:
            out["goodput_per_gpu"][key] = _per_gpu(runs, traces, gpus)
        save_partial(args, out)
    return out


def _measure_cluster(args, model: Path, logs: Path, key: str, mode: str, workers: list, res: dict,
                     want_handover: bool, rates: dict[str, list[float]], after_run) -> None:
    """One cluster: warm-up, then the handover (if asked), then each trace at each offered rate, into `res`."""
    with Cluster(args, model, "disaggregated" if mode == "disagg" else "colocated", workers, logs,
                 f"{key}-{mode}") as c:
        # warm-up past the disaggregation threshold: connections, NIXL handshakes, kernels' first runs
        warm = _prompts(2, args.disagg_threshold + 256, SHAPES[args.shape]["vocab_size"], 3)
        asyncio.run(_sequential(c.url, args.shape, warm, 4))
        res["kv_transports"] = c.kv_transports()
        if want_handover:
            before = c.stage_totals() if mode == "disagg" else None
            res["handover"] = handover(c.url, args)
            if before is not None:  # where the disaggregated TTFT went, over the same requests
                res["handover"]["stages_ms"] = stage_means_ms(before, c.stage_totals())
            after_run()
        runs_here = 0
        for trace, trace_rates in rates.items():
            if args.warmup_duration > 0:  # the first pass of a trace's lengths builds kernels: measured twice, the
                # second run of a rate served 1.2-2.6x the first on 4x H200, in both modes, with other prompts
                try:
                    bench(args, c.url, trace, max(trace_rates), seed=1000, duration=args.warmup_duration)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"[{key} {mode} {trace}] warm-up failed: {e}", file=sys.stderr, flush=True)
            for rate in trace_rates:
                before = c.counters()
                runs_here += 1
                try:
                    r = bench(args, c.url, trace, rate, seed=runs_here)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"[{key} {mode} {trace} @{rate}] failed: {e}", file=sys.stderr, flush=True)
                    res.setdefault(trace, []).append({"offered_rps": rate, "error": str(e)[-500:]})
                    after_run()
                    continue
                after = c.counters()
                r["prefill_counters"] = {k: after[k] - before.get(k, 0.0) for k in after
                                         if after[k] != before.get(k, 0.0)}
                print(f"[{key} {mode} {trace} @{rate}] goodput {r['goodput_rps']} req/s, ttft p50 "
                      f"{r['ttft_p50_s']} p99 {r['ttft_p99_s']}, itl p50 {r['itl_p50_s']} p99 "
                      f"{r['itl_p99_s']}, failed {r['failed']} {r['prefill_counters']}", file=sys.stderr, flush=True)
                res.setdefault(trace, []).append(r)
                after_run()


def _after_run(args, out: dict, key: str, runs: dict, traces: list[str], gpus: int) -> None:
    if traces:
        out["goodput_per_gpu"][key] = _per_gpu(runs, traces, gpus)
    save_partial(args, out)


def _per_gpu(runs: dict, traces: list[str], gpus: int) -> dict:
    """Per trace and mode: the best goodput over the offered rates, over the GPUs used (None: not measured)."""
    def best(mode: str, trace: str) -> float | None:
        ok = [r["goodput_rps"] for r in runs.get(mode, {}).get(trace, []) if "goodput_rps" in r]
        return round(max(ok) / gpus, 4) if ok else None

    return {t: {m: best(m, t) for m in ("disagg", "colocated")} for t in traces}


_PARTIAL: dict = {}


def save_partial(args, part: dict) -> None:
    """Keep what was measured so far in the output file (a long run cut short still leaves its numbers)."""
    if args.partial:
        _PARTIAL.update(part)
        Path(args.partial).write_text(json.dumps(_PARTIAL, indent=1))


def part_burst(args, model: Path, logs: Path) -> dict:
    """Prefill throughput through the whole serving stack: --burst-requests prompts of --burst-len tokens sent at
    once (2 output tokens each) to a 1P+1D cluster and to one colocated worker with the prefill worker's chunk
    budget, against the engine's own prefill rate (~40k tokens/s for 8B on an H200, gpu_engine_nvidia_h200.json)."""
    vocab = SHAPES[args.shape]["vocab_size"]
    out: dict = {"requests": args.burst_requests, "prompt_tokens": args.burst_len}
    flags = worker_args(args, "prefill")
    for mode, workers in (("disagg", [("prefill", [0], flags), ("decode", [1], worker_args(args, "decode"))]),
                          ("colocated", [("both", [0], flags)])):
        with Cluster(args, model, "disaggregated" if mode == "disagg" else "colocated", workers, logs,
                     f"burst-{mode}") as c:
            asyncio.run(_sequential(c.url, args.shape, _prompts(2, args.burst_len, vocab, 6), 2))
            burst = _prompts(args.burst_requests, args.burst_len, vocab, 7)
            res = asyncio.run(_concurrent(c.url, args.shape, burst, 2))
        ok = [(t, r) for t, r in res if r.ok]
        t0 = min(t for t, _ in res)
        wall = max(t + r.ttft for t, r in ok) - t0 if ok else None
        out[mode] = {"ok": len(ok), "wall_s": wall,
                     "prefill_tok_s": len(ok) * args.burst_len / wall if wall else None,
                     "ttft_p50_ms": statistics.median(r.ttft for _, r in ok) * 1e3 if ok else None,
                     "ttft_max_ms": max(r.ttft for _, r in ok) * 1e3 if ok else None}
        print(f"[burst {mode}] {out[mode]}", file=sys.stderr, flush=True)
    return out


def moe_placement(args) -> tuple[list[int], list[int], bool]:
    """(prefill GPUs, decode GPUs, whether the prefill worker shares GPU 0 with decode rank 0)."""
    if args.moe_share_gpu:  # 2 GPUs: the prefill worker beside decode rank 0 on GPU 0
        return [0], [0, 1], True
    dec_gpus = [1, 2] if args.gpus >= 3 else [0, 1]  # CPU dry run: the prefill worker shares "GPU" 0
    if args.moe_decode_tp == 1:  # the diagnosis: the same run with no sharding (prefill TP=1 into decode TP=1)
        dec_gpus = dec_gpus[1:]
    return [0], dec_gpus, 0 in dec_gpus


def moe_kv(args) -> tuple[str, str]:
    """KV cache memory of the prefill worker and of each decode rank (and colocated rank)."""
    shared = ("10GiB", "16GiB") if args.moe_share_gpu else (args.moe_kv_cache_memory, args.moe_kv_cache_memory)
    return args.moe_prefill_kv_cache_memory or shared[0], args.moe_decode_kv_cache_memory or shared[1]


def part_moe(args, logs: Path) -> dict:
    """Qwen3-30B-A3B shape: decode tokens/s at batch --moe-batch, disaggregated (prefill TP=1 into decode TP=2
    with expert parallelism) against colocated TP=2 EP on the decode GPUs (the same requests, sent at once).
    Tokens/s is counted in the window where every request is decoding: from the last first token (every
    prefill done) to the first last token. With --moe-share-gpu the prefill worker and decode rank 0 share
    GPU 0, each with an explicit KV size, so the part runs on 2 GPUs."""
    shape = "qwen3_30b_a3b" if args.device == "cuda" else "tiny"
    sub = argparse.Namespace(**{**vars(args), "shape": shape})
    model = model_dir(shape, Path(tempfile.mkdtemp(prefix="splitserve-moe-")))
    pre_gpu, dec_gpus, shared = moe_placement(args)
    ep = ["--expert-parallel"] if len(dec_gpus) > 1 else []
    pre_kv, dec_kv = moe_kv(args)
    seqs = ["--max-num-seqs", str(max(args.moe_batch, 8))]
    out: dict = {"shape": shape, "batch": args.moe_batch, "prompt_tokens": args.moe_input,
                 "output_tokens": args.moe_output, "prefill_gpus": pre_gpu, "decode_gpus": dec_gpus,
                 "colocated_gpus": dec_gpus, "prefill_shares_gpu0_with_decode_rank0": shared,
                 "kv_cache_memory": {"prefill": pre_kv, "decode_per_rank": dec_kv, "colocated_per_rank": dec_kv}}
    prompts = _prompts(args.moe_batch, args.moe_input, SHAPES[shape]["vocab_size"], 4)
    for mode, workers in (("disagg", [("prefill", pre_gpu, seqs + ["--kv-cache-memory", pre_kv,
                                                                   "--max-num-batched-tokens", "8192"]),
                                      ("decode", dec_gpus, seqs + ["--kv-cache-memory", dec_kv] + ep)]),
                          ("colocated", [("both", dec_gpus, seqs + ["--kv-cache-memory", dec_kv] + ep)])):
        sub.disagg_threshold = min(args.disagg_threshold, args.moe_input)
        with Cluster(sub, model, "disaggregated" if mode == "disagg" else "colocated", workers, logs,
                     f"moe-{mode}") as c:
            asyncio.run(_sequential(c.url, shape, _prompts(2, args.moe_input, SHAPES[shape]["vocab_size"], 5), 4))
            before, stages_before = c.counters(), c.stage_totals()
            res = asyncio.run(_concurrent(c.url, shape, prompts, args.moe_output))
            after, stages_after = c.counters(), c.stage_totals()
        counters = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
        out[f"{mode}_prefill_counters"] = counters
        if mode == "disagg":  # of the batch's requests: KV streamed in, or prefilled on the decode worker
            out["disagg_remote_prefilled"] = int(counters.get('splitserve_remote_prefill_total{outcome="ok"}', 0))
            out["disagg_fell_back"] = int(counters.get('splitserve_local_prefill_total{reason="fallback"}', 0))
            out["disagg_prefilled_locally"] = int(sum(v for k, v in counters.items()
                                                      if k.startswith("splitserve_local_prefill_total")))
            out["disagg_handover_stages_ms"] = stage_means_ms(stages_before, stages_after)
        ok = [r for _, r in res if r.ok]
        if len(ok) < len(res):
            raise RuntimeError(f"moe {mode}: {len(res) - len(ok)} requests failed: {res[0][1].error}")
        # tokens/s while every request is decoding: between the last first token and the first last token
        times = [[start + r.ttft + sum(r.itls[:i]) for i in range(len(r.itls) + 1)] for start, r in res]
        lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
        n = sum(lo <= x <= hi for t in times for x in t)
        out[f"{mode}_window_s"] = hi - lo
        out[f"{mode}_decode_tok_s"] = n / (hi - lo) if hi > lo else None
        out[f"{mode}_step_ms"] = 1e3 * (hi - lo) / (n / len(res)) if hi > lo and n else None
        out[f"{mode}_ttft_p50_ms"] = statistics.median(r.ttft for r in ok) * 1e3
        print(f"[moe {mode}] {out[f'{mode}_decode_tok_s']} tok/s over a {hi - lo:.2f} s window, TTFT p50 "
              f"{out[f'{mode}_ttft_p50_ms']:.0f} ms {counters}", file=sys.stderr, flush=True)
    return out


async def _concurrent(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    """Every prompt at once; (start time, result) each, start on the perf_counter clock."""
    import httpx

    from splitserve.bench import Job, one

    async def timed(client, p):
        start = time.perf_counter()
        return start, await one(client, url, model, Job(0.0, p, max_tokens))

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        return await asyncio.gather(*(timed(client, p) for p in prompts))


PARTS = ("transfer", "handover", "goodput", "burst", "moe")


def check_args(args, parts: list[str]) -> str | None:
    """What is wrong with the command line, in one line (None: nothing)."""
    from splitserve.common.config import EngineSpec

    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        return f"--parts: unknown {','.join(unknown)} (choose from {','.join(PARTS)})"
    bad = [c for c in args.configs.split(",") if c not in CONFIGS]
    if bad:
        return f"--configs: unknown {','.join(bad)} (choose from {','.join(CONFIGS)})"
    moe_flags = [name for name, value in (("--moe-share-gpu", args.moe_share_gpu),
                                          ("--moe-prefill-kv-cache-memory", args.moe_prefill_kv_cache_memory),
                                          ("--moe-decode-kv-cache-memory", args.moe_decode_kv_cache_memory))
                 if value]
    if moe_flags and "moe" not in parts:
        return f"{moe_flags[0]} applies to the moe part only: add moe to --parts"
    if args.moe_share_gpu and args.moe_decode_tp != 2:
        return "--moe-share-gpu places decode TP=2 on GPUs 0-1 beside the prefill worker; --moe-decode-tp 1 " \
               "shares nothing (leave out --moe-share-gpu)"
    for flag in ("kv_cache_memory", "moe_kv_cache_memory", "moe_prefill_kv_cache_memory",
                 "moe_decode_kv_cache_memory"):
        value = getattr(args, flag)
        if value is not None:
            try:
                EngineSpec(kv_cache_memory=value)
            except ValueError:
                return f"--{flag.replace('_', '-')}: {value!r} is not a size (16GiB), a fraction (0.9) or auto"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--parts", default="transfer,handover,goodput,moe")
    ap.add_argument("--configs", default="1p1d", help="comma-separated: 1p1d, 1p3d, 2p2d")
    ap.add_argument("--traces", default="azure_conv,azure_code")
    ap.add_argument("--rates", default="azure_conv=12/24,azure_code=8/16",
                    help="offered requests/s per trace, several separated by /")
    ap.add_argument("--trace-dir", type=Path, default=TRACES,
                    help="folder of the Azure trace CSVs (a device machine gets no ../shared: carry them)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per goodput run")
    ap.add_argument("--warmup-duration", type=float, default=8.0,
                    help="seconds of arrivals of an unmeasured run of each trace (at its highest rate, other "
                         "prompts) before its goodput runs on each cluster; 0: none")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-itl", type=float, default=0.05)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-input-len", type=int, default=7168)
    ap.add_argument("--max-output-len", type=int, default=512)
    ap.add_argument("--kv-transport", default="auto")
    ap.add_argument("--kv-cache-memory", default="40GiB")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--prefill-budget", type=int, default=8192, help="tokens per step on a prefill worker")
    ap.add_argument("--decode-budget", type=int, default=2048, help="tokens per step on a decode worker")
    ap.add_argument("--colocated-budget", type=int, default=512,
                    help="tokens per step on a colocated worker (chunked prefill sized for the ITL SLO)")
    ap.add_argument("--disagg-threshold", type=int, default=512)
    ap.add_argument("--handover-len", type=int, default=3072)
    ap.add_argument("--handover-output", type=int, default=16)
    ap.add_argument("--handover-requests", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--burst-requests", type=int, default=32)
    ap.add_argument("--burst-len", type=int, default=2048)
    ap.add_argument("--moe-batch", type=int, default=64)
    ap.add_argument("--moe-input", type=int, default=1024)
    ap.add_argument("--moe-output", type=int, default=256)
    ap.add_argument("--moe-decode-tp", type=int, choices=[1, 2], default=2,
                    help="decode TP (EP when 2); 1 runs the same requests with no KV sharding, for comparison")
    ap.add_argument("--moe-kv-cache-memory", default="12GiB", help="KV cache memory of each MoE worker (rank)")
    ap.add_argument("--moe-share-gpu", action="store_true",
                    help="2 GPUs: the MoE prefill worker on GPU 0 beside decode rank 0 (decode TP=2 EP on GPUs "
                         "0-1); KV sizes default to 10GiB (prefill) and 16GiB (each decode rank)")
    ap.add_argument("--moe-prefill-kv-cache-memory", default=None,
                    help="KV cache memory of the MoE prefill worker (default: --moe-kv-cache-memory, or 10GiB "
                         "with --moe-share-gpu)")
    ap.add_argument("--moe-decode-kv-cache-memory", default=None,
                    help="KV cache memory of each MoE decode rank and colocated rank (default: "
                         "--moe-kv-cache-memory, or 16GiB with --moe-share-gpu)")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs on this host (default: all visible)")
    ap.add_argument("--tag", default=None, help="file name part (default: the GPU name and count)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--update", default=None, help="merge into this result file")
    ap.add_argument("--logs", default=None, help="directory for the processes' logs")
    ap.add_argument("--partial", default=None, help="write what is measured so far to this file as it comes")
    args = ap.parse_args()
    parts = args.parts.split(",")
    problem = check_args(args, parts)
    if problem:
        sys.exit(f"serving_gpu: {problem}")

    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("serving_gpu: no GPU visible (use --device cpu for a dry run)")
        args.gpus = args.gpus or torch.cuda.device_count()
        gpu = torch.cuda.get_device_name(0)
    else:
        args.gpus = args.gpus or 4
        gpu = None
    need = max(sum(CONFIGS[c]) for c in args.configs.split(",")) if "goodput" in args.parts else 2
    if args.gpus < need:
        sys.exit(f"serving_gpu: the parts asked for need {need} GPUs, {args.gpus} are visible")
    if "moe" in parts and args.device == "cuda" and not args.moe_share_gpu and args.gpus < 3:
        sys.exit(f"serving_gpu: --parts moe needs 3 GPUs (prefill on one, decode on two), {args.gpus} are "
                 f"visible: add --moe-share-gpu to place the prefill worker beside decode rank 0")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="splitserve-serving-gpu-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.shape, Path(tempfile.mkdtemp(prefix="splitserve-model-")))
    result: dict = {"gpu": gpu, "gpus": args.gpus, "shape": args.shape, "device": args.device,
                    "slo": {"ttft_s": args.slo_ttft, "itl_s": args.slo_itl},
                    "settings": {k: getattr(args, k) for k in ("prefill_budget", "decode_budget", "colocated_budget",
                                                               "kv_cache_memory", "max_num_seqs", "duration",
                                                               "rates", "kv_transport", "disagg_threshold")}}
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: unwind, so the clusters are stopped
    if "transfer" in parts:
        try:
            result.update(part_transfer(args))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
            result["transfer_error"] = str(e)[-2000:]
            print(f"[transfer] failed: {e}", file=sys.stderr, flush=True)
    save_partial(args, result)
    if "handover" in parts or "goodput" in parts:
        serving = part_serving(args, model, logs, "handover" in parts, "goodput" in parts)
        if "handover" in serving:
            result["handover"] = serving["handover"]
            result["handover_ms"] = serving["handover"]["handover_ms"]
            result["decode_step_ms"] = serving["handover"]["decode_step_ms"]
            result["handover_stages_ms"] = serving["handover"]["stages_ms"]
        if "goodput" in parts:
            result["goodput_per_gpu"], result["goodput_runs"] = serving["goodput_per_gpu"], serving["goodput_runs"]
        save_partial(args, result)
    for name, run in (("burst", lambda: part_burst(args, model, logs)), ("moe", lambda: part_moe(args, logs))):
        if name in parts:
            try:
                result[name] = run()
            except (RuntimeError, TimeoutError, OSError) as e:
                result[name] = {"error": str(e)[-2000:]}
                print(f"[{name}] failed: {e}", file=sys.stderr, flush=True)
            save_partial(args, result)
    result["wall_s"] = round(time.monotonic() - t0, 1)

    tag = args.tag or (f"{(gpu or 'cpu').split()[-1].lower()}x{args.gpus}")
    path = Path(args.out or ROOT / "benchmarks" / "results" / f"serving_gpu_{tag}.json")
    if args.update:
        old = json.loads(Path(args.update).read_text())
        for k, v in result.items():
            if isinstance(v, dict) and isinstance(old.get(k), dict) and k == "goodput_per_gpu":
                old[k].update(v)
            else:
                old[k] = v
        result, path = old, Path(args.update)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(json.dumps(result))


def _f(x, d=2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def print_stages(title: str, stages: dict | None) -> None:
    """Mean ms per stage, one line per role, in the workers' stage order."""
    if not stages:
        return
    print(f"{title} (mean ms over {stages.get('requests', 0):.0f} remote prefills):")
    for role in STAGE_METRICS:
        print(f"  {role:<8}" + "  ".join(f"{k} {_f(v, 3)}" for k, v in (stages.get(role) or {}).items()))
    print(f"  rpc hops {_f(stages.get('rpc_hops'), 3)} (decode's prefill stage less the prefill worker's stages)")


def print_table(r: dict) -> None:
    f = _f

    print(f"gpu={r.get('gpu')} x{r.get('gpus')} shape={r.get('shape')}")
    print(f"transfer {f(r.get('transfer_gbps'))} GB/s layer-wise (whole {f(r.get('transfer_whole_gbps'))}) vs "
          f"peer copy {f(r.get('p2p_copy_gbps'))} GB/s; tail after last layer {f(r.get('transfer_tail_ms'))} ms")
    print(f"handover {f(r.get('handover_ms'))} ms vs decode step {f(r.get('decode_step_ms'))} ms")
    print_stages("handover stages", r.get("handover_stages_ms"))
    for config, traces in (r.get("goodput_per_gpu") or {}).items():
        for trace, v in traces.items():
            d, c = v.get("disagg"), v.get("colocated")
            ratio = d / c if d is not None and c else None
            print(f"goodput/GPU {config:<12}{trace:<12} disagg {f(d, 3)}  colocated {f(c, 3)}  ratio {f(ratio)}")
    burst = r.get("burst") or {}
    for mode in ("disagg", "colocated"):
        if isinstance(burst.get(mode), dict):
            print(f"burst prefill {mode}: {f(burst[mode].get('prefill_tok_s'), 0)} tokens/s")
    moe = r.get("moe")
    if moe and "batch" in moe:
        placement = "prefill beside decode rank 0 on GPU 0" if moe.get("prefill_shares_gpu0_with_decode_rank0") \
            else f"prefill on GPU {moe.get('prefill_gpus')}"
        print(f"moe decode tok/s at batch {moe['batch']}: disagg {f(moe.get('disagg_decode_tok_s'), 0)} "
              f"colocated EP on GPUs {moe.get('colocated_gpus')} {f(moe.get('colocated_decode_tok_s'), 0)} "
              f"({placement})")
        print(f"moe TTFT p50 ms: disagg {f(moe.get('disagg_ttft_p50_ms'), 0)} colocated "
              f"{f(moe.get('colocated_ttft_p50_ms'), 0)}; remote prefills {moe.get('disagg_remote_prefilled')} of "
              f"{moe['batch']}, fell back {moe.get('disagg_fell_back')}")
        print_stages("moe handover stages", moe.get("disagg_handover_stages_ms"))


if __name__ == "__main__":
    main()
