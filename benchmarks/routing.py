"""KV-aware routing on this CPU: a Mooncake shared-prefix replay per routing policy, the global KV index's speed,
and vllm-router's cache_aware policy in front of the same workers.

  replay  A slice of ../shared/traces/mooncake_conversation.jsonl (whole conversations sampled from a time window,
          so later turns find their earlier turns' blocks; hash ids become shared 512-token blocks) through
          `splitserve up --mode colocated --decode 2 --routing P` with `splitserve bench`, once per policy (a fresh
          cluster each time, so every policy starts cold). Hit rate = matched / prompt tokens from the workers' own
          counters (deltas over the run); TTFT and throughput from `splitserve bench --json`.
  micro   In process, no servers: KV events decoded from the wire format (`redis_wire`) and applied to one
          `KVIndex` (build a 1M-block index over 64 workers with shared prefixes, then churn it), and
          `KVAware.route` latency for 8k-token prompts (512 block hashes, computed beforehand as a gateway does).
  vllm    `vllm-router --policy cache_aware` (from PyPI, its own venv: --vllm-router PATH) in front of one splitserve
          gateway per worker (static membership), on the same replay.

Prints a table and ends with one JSON line (`hit_rate`, `ttft_p50_s`: objects keyed by policy;
`index_events_per_s`, `decision_p99_ms`; `vllm_router_hit_rate` when measured). --micro-only skips the servers.
"""

from __future__ import annotations

import argparse
import gc
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

import numpy as np
from harness import (
    BIN,
    RESULTS,
    TRACES,
    Cluster,
    bench_trace,
    fmt,
    http_json,
    metric_total,
    save,
    scrape,
    slice_stats,
    trace_slice,
    wait_until,
    warm_up,
)

from splitserve.common.proc import free_port
from splitserve.common.redis_wire import KVEventRecord
from splitserve.router.kv_index import KVIndex
from splitserve.router.policy import KVAware, RequestFeatures, WorkerLoad

POLICIES = ("kv_aware", "round_robin", "least_loaded")
GOALS = {"hit_ratio_vs_rr": 3.0, "ttft_p50_speedup_vs_rr": 2.0, "index_events_per_s": 500_000, "decision_p99_ms": 0.5}


# -- the replay ------------------------------------------------------------------------------------------------
def worker_counters(cluster: Cluster) -> list[tuple[float, float]]:
    """(prefix-hit tokens, prompt tokens) of each worker, from its own /metrics."""
    return [(metric_total(m, "splitserve_worker_prefix_hit_tokens_total"),
             metric_total(m, "splitserve_worker_prompt_tokens_total")) for m in cluster.worker_metrics("decode")]


def gateway_hit_tokens(url: str) -> float:
    """The gateway's splitserve_router_prefix_hit_tokens_total: prompt tokens its decisions expected cached."""
    return metric_total(scrape(url), "splitserve_router_prefix_hit_tokens_total")


def replay_once(policy: str, trace: Path, n: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One fresh cluster, one replay: the policy's hit rate and the bench's summary. `policy` is a splitserve
    policy, or `vllm_router` (cache_aware in front of one static gateway per worker)."""
    routing, _, weight = ("round_robin" if policy == "vllm_router" else policy).partition("@")
    doc = None
    if weight:  # kv_aware@W: router.kvAware.overlapWeight W
        doc = workdir / f"overlap-{weight}.yaml"
        doc.write_text("apiVersion: splitserve.dev/v1alpha1\nkind: SplitServeCluster\nmetadata: {name: routing-bench}\n"
                       f"spec:\n  router: {{kvAware: {{overlapWeight: {float(weight)}}}}}\n")
    with Cluster("--mode", "colocated", "--decode", "2", "--routing", routing, "--kv-cache-memory",
                 args.kv_cache_memory, file=doc, name=policy, log_dir=workdir) as cluster:
        url = cluster.url
        if routing == "kv_aware":
            wait_until(lambda: http_json(url + "/health")["index"]["usable"], 60, "the KV index")
        if policy == "vllm_router":
            url = front_with_vllm_router(cluster, args)
        warm_up(url)
        before, expected = worker_counters(cluster), gateway_hit_tokens(cluster.url)
        summary = bench_trace(url, trace, n, args)
        after, expected = worker_counters(cluster), gateway_hit_tokens(cluster.url) - expected
    hit = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    prompt = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    per_worker = [int(a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    return {"policy": policy, "hit_rate": round(hit / prompt, 4) if prompt else None, "hit_tokens": int(hit),
            "router_expected_hit_tokens": int(expected) if policy != "vllm_router" else None,
            "prompt_tokens": int(prompt), "prompt_tokens_per_worker": per_worker, "load_1m": os.getloadavg()[0],
            **{k: summary[k] for k in ("completed", "failed", "duration_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
                                       "e2e_p50_s", "output_tok_s", "request_rps", "errors")}}


# vllm-router forwards sglang-style defaults that our gateway refuses (it ignores no field silently): drop them
VLLM_ROUTER_DEFAULTS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}


def strip_proxy(upstream: str, port: int) -> None:
    """An HTTP proxy to one gateway that removes VLLM_ROUTER_DEFAULTS from request bodies (and nothing else)."""
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def forward(request: Request) -> Response:
        body = await request.body()
        if body:
            data = json.loads(body)
            for k, v in VLLM_ROUTER_DEFAULTS.items():
                if data.get(k, v) == v:
                    data.pop(k, None)
            body = json.dumps(data).encode()
        req = client.build_request(request.method, request.url.path, content=body or None,
                                   headers={"content-type": request.headers.get("content-type", "application/json")})
        resp = await client.send(req, stream=True)
        return StreamingResponse(resp.aiter_raw(), resp.status_code, media_type=resp.headers.get("content-type"),
                                 background=BackgroundTask(resp.aclose))

    paths = ["/health", "/v1/models", "/v1/completions", "/v1/chat/completions"]
    app = Starlette(routes=[Route(p, forward, methods=["GET", "POST"]) for p in paths])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def front_with_vllm_router(cluster: Cluster, args: argparse.Namespace) -> str:
    """One splitserve gateway per worker (static membership from the cluster's effective config), each behind a
    proxy that drops the fields vllm-router adds, and vllm-router's cache_aware policy over them, all started as
    processes of the cluster. Returns vllm-router's URL."""
    gateways = []
    for w in cluster.components["decode"]:
        port, proxy = free_port(), free_port()
        cluster.spawn(f"gateway-{w['name']}", [str(BIN / "splitserve"), "router", "--config",
                                               cluster.components["config"], "--decode", w["grpc"], "--mode",
                                               "colocated", "--routing", "least_loaded", "--port", str(port)])
        cluster.spawn(f"proxy-{w['name']}", [sys.executable, __file__, "--strip-proxy", f"http://127.0.0.1:{port}",
                                             "--proxy-port", str(proxy)])
        gateways.append(f"http://127.0.0.1:{proxy}")
    for g in gateways:
        wait_until(lambda g=g: http_json(g + "/health")["all_healthy"], 120, f"gateway {g}")
    port = free_port()
    cluster.spawn("vllm-router", [args.vllm_router, "--worker-urls", *gateways, "--policy", "cache_aware", "--host",
                                  "127.0.0.1", "--port", str(port), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: urllib.request.urlopen(url + "/health", timeout=5).status == 200, 120, "vllm-router")
    return url


def run_replay(args: argparse.Namespace) -> dict:
    rows = trace_slice(TRACES / args.trace, args.window_start, args.window_seconds, args.sample, args.min_turns,
                       args.seed)
    stats = slice_stats(rows, args.max_input_len)
    workdir = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    trace = workdir / "slice.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    policies = [p for p in args.policies.split(",") if p]
    if args.vllm_router:
        policies.append("vllm_router")
    runs: list[dict] = []
    for rep in range(args.repeats):
        for policy in policies:
            print(f"[replay {rep + 1}/{args.repeats}] {policy}: {len(rows)} requests (load {os.getloadavg()[0]:.2f})",
                  file=sys.stderr, flush=True)
            runs.append(replay_once(policy, trace, len(rows), args, workdir))
            print(f"  -> {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    return {"slice": stats, "runs": runs, "logs": str(workdir)}


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 4) if got else None


def medians(runs: list[dict]) -> dict[str, dict]:
    """Per policy: the median of each number over its repeats."""
    out: dict[str, dict] = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = [r for r in runs if r["policy"] == policy]
        out[policy] = {k: _median([r[k] for r in mine])
                       for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "output_tok_s", "request_rps", "load_1m")}
        out[policy]["failed"] = sum(r["failed"] for r in mine)
        out[policy]["repeats"] = len(mine)
    return out


# -- the index microbenchmark ---------------------------------------------------------------------------------
class _Fleet:
    """A synthetic cluster's caches: system prompts shared by many workers, conversations held by one worker or
    a few (turns that went elsewhere), as chains of random 64-bit block hashes (what blake2b chains look like)."""

    def __init__(self, num_blocks: int, num_workers: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.workers = [f"worker-{i:02d}" for i in range(num_workers)]
        self.instances = {w: f"inst-{i:02d}" for i, w in enumerate(self.workers)}
        rng = self.rng
        self.systems = [self._chain(int(rng.integers(32, 257))) for _ in range(16)]  # 0.5k-4k tokens
        self.convs: list[tuple[int, np.ndarray, list[int]]] = []  # (system prompt, own blocks, holders)
        distinct = sum(len(s) for s in self.systems)
        popularity = 1.0 / np.arange(1, 17)
        popularity /= popularity.sum()
        while distinct < num_blocks:
            length = int(np.clip(rng.lognormal(4.3, 0.9), 8, 1024))  # median ~74 blocks (1.2k tokens)
            holders = [int(rng.integers(num_workers))]
            while rng.random() < 0.3 and len(holders) < 4:
                holders.append(int(rng.integers(num_workers)))
            self.convs.append((int(rng.choice(16, p=popularity)), self._chain(length), sorted(set(holders))))
            distinct += length

    def _chain(self, n: int) -> np.ndarray:
        return self.rng.integers(1, 2**64 - 1, size=n, dtype=np.uint64)

    def _records(self, worker: int, kind: str, hashes: np.ndarray, mean: float) -> list[KVEventRecord]:
        """A worker's events for `hashes`, cut as its publisher would cut them: one record per 50 ms flush
        (sizes exponential around `mean`)."""
        out, i = [], 0
        while i < len(hashes):
            n = max(1, int(self.rng.exponential(mean)))
            out.append(KVEventRecord(self.workers[worker], self.instances[self.workers[worker]], kind, "gpu",
                                     hashes[i : i + n]))
            i += n
        return out

    def build_events(self, mean: float) -> list[KVEventRecord]:
        held: set[tuple[int, int]] = set()
        out = []
        for system, own, holders in self.convs:
            for w in holders:
                if (w, system) not in held:
                    held.add((w, system))
                    out += self._records(w, "stored", self.systems[system], mean)
                out += self._records(w, "stored", own, mean)
        self.rng.shuffle(out)  # workers' streams interleave
        return out

    def churn_events(self, fraction: float, mean: float) -> list[KVEventRecord]:
        """Evict a `fraction` of the conversations (removed) and store as many new ones (stored)."""
        out = []
        for k in self.rng.choice(len(self.convs), size=int(fraction * len(self.convs)), replace=False):
            system, own, holders = self.convs[k]
            for w in holders:
                out += self._records(w, "removed", own, mean)
            fresh = self._chain(len(own))
            for w in holders:
                out += self._records(w, "stored", fresh, mean)
            self.convs[k] = (system, fresh, holders)
        return out


def _wire(records: list[KVEventRecord]) -> list[dict[bytes, bytes]]:
    """The records as a stream read returns them (redis-py: bytes field names and values)."""
    return [{k.encode(): v for k, v in rec.encode().items()} for rec in records]


def ingest(index: KVIndex, entries: list[dict[bytes, bytes]], live: dict[str, str]) -> tuple[float, float, int]:
    """Decode and apply, as ClusterState._read does; returns (wall seconds, CPU seconds, block events applied)."""
    before = index.events_applied
    t0, c0 = time.perf_counter(), time.thread_time()
    for fields in entries:
        index.apply(KVEventRecord.decode(fields), live)
    return time.perf_counter() - t0, time.thread_time() - c0, index.events_applied - before


class _Source:
    """The policy's view of the cluster state: the index, and live instances rebuilt per call (as membership is)."""

    def __init__(self, index: KVIndex, live: dict[str, str]) -> None:
        self.index = index
        self._entries = list(live.items())
        self.usable = True

    def instances(self) -> dict[str, str]:
        return {name: inst for name, inst in self._entries}


class _View:
    def __init__(self, workers: list[WorkerLoad]) -> None:
        self.workers = workers

    def candidates(self, role: str) -> list[WorkerLoad]:
        return [w for w in self.workers if w.serves(role) and w.available]


def run_micro(args: argparse.Namespace) -> dict:
    t_build = time.perf_counter()
    fleet = _Fleet(args.micro_blocks, args.micro_workers, args.seed)
    build = _wire(fleet.build_events(args.micro_hashes_per_record))
    churn = _wire(fleet.churn_events(0.2, args.micro_hashes_per_record))
    singles = _wire([KVEventRecord(fleet.workers[0], fleet.instances[fleet.workers[0]], "stored", "gpu", h)
                     for h in np.array_split(fleet._chain(args.micro_single_records), args.micro_single_records)])
    setup_s = time.perf_counter() - t_build
    live = dict(fleet.instances)
    index = KVIndex()
    build_s, build_cpu, build_n = ingest(index, build, live)
    churn_s, churn_cpu, churn_n = ingest(index, churn, live)
    blocks = index.num_blocks
    single_s, _, single_n = ingest(KVIndex(), singles, live)
    build_records, churn_records = len(build), len(churn)
    del build, churn, singles
    gc.collect()

    # decisions: 8k-token prompts over the 64-worker index
    rng = random.Random(args.seed)
    workers = [WorkerLoad(w, f"10.0.0.{i}:50051", "both", instance_id=live[w], outstanding=rng.randrange(8),
                          pending_prefill_blocks=rng.randrange(2048), decoding_blocks=rng.randrange(4096))
               for i, w in enumerate(fleet.workers)]
    policy = KVAware(_Source(index, live), block_size=16, threshold=512)
    view = _View(workers)
    nblocks = args.micro_prompt_tokens // 16
    requests = []
    token_ids = list(range(args.micro_prompt_tokens))  # one list for every request: only its length is read
    for _ in range(args.micro_decisions):
        system, own, _ = fleet.convs[rng.randrange(len(fleet.convs))]
        held = np.concatenate([fleet.systems[system], own])[: rng.choice((nblocks, rng.randrange(nblocks)))]
        hashes = np.concatenate([held, fleet._chain(nblocks - len(held))]).tolist()
        req = RequestFeatures(token_ids, 16, "smollm2")
        req.__dict__["block_hashes"] = hashes  # computed before routing, off the event loop
        requests.append(req)
    for req in requests[:50]:
        policy.route(req, view)
    times, cpu = [], []
    matched = 0
    for req in requests:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        d = policy.route(req, view)
        cpu.append(time.thread_time_ns() - c0)
        times.append(time.perf_counter_ns() - t0)
        matched += d.cached_tokens
    times.sort()
    cpu.sort()

    def pick(q: float, values: list[int] = times) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] / 1e6
    return {"blocks": blocks, "workers": args.micro_workers, "index_memory_mb": round(index.memory_bytes() / 2**20),
            "setup_s": round(setup_s, 2),
            "build_events": build_n, "build_records": build_records, "build_events_per_s": round(build_n / build_s),
            "churn_events": churn_n, "churn_records": churn_records, "churn_events_per_s": round(churn_n / churn_s),
            "index_events_per_s": round((build_n + churn_n) / (build_s + churn_s)),
            "index_events_per_cpu_s": round((build_n + churn_n) / (build_cpu + churn_cpu)),
            "index_records_per_s": round((build_records + churn_records) / (build_s + churn_s)),
            "hashes_per_record": round((build_n + churn_n) / (build_records + churn_records), 1),
            "single_hash_records_per_s": round(single_n / single_s),
            "decisions": len(times), "prompt_tokens": args.micro_prompt_tokens,
            "decision_p50_ms": round(pick(0.5), 4), "decision_p99_ms": round(pick(0.99), 4),
            "decision_max_ms": round(times[-1] / 1e6, 4),
            "decision_cpu_p50_ms": round(pick(0.5, cpu), 4), "decision_cpu_p99_ms": round(pick(0.99, cpu), 4),
            "mean_cached_tokens": round(matched / len(times)), "load_1m": os.getloadavg()[0]}


# -- output ----------------------------------------------------------------------------------------------------
def table(result: dict) -> str:
    lines = []
    if result.get("replay"):
        s = result["replay"]["slice"]
        lines += [f"replay: {s['requests']} requests, {s['conversations']} conversations "
                  f"({s['multi_turn_conversations']} multi-turn); oracle hit rate {s['oracle_hit_rate']}, "
                  f"system prompt {s['system_prompt_share']} of prompt tokens",
                  f"{'policy':<14}{'hit rate':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'tok/s':>8}{'req/s':>8}"
                  f"{'failed':>8}{'load':>7}{'runs':>6}"]
        for policy, m in result["replay"]["median"].items():
            lines.append(f"{policy:<14}{fmt(m['hit_rate'], 3, 10)}{fmt(m['ttft_p50_s'], 2, 10)}"
                         f"{fmt(m['ttft_p99_s'], 2, 10)}{fmt(m['output_tok_s'], 2, 8)}{fmt(m['request_rps'], 3, 8)}"
                         f"{m['failed']:>8}{fmt(m['load_1m'], 2, 7)}{m['repeats']:>6}")
    if result.get("micro"):
        m = result["micro"]
        lines += [f"index: {m['blocks']} blocks over {m['workers']} workers (~{m['index_memory_mb']} MiB)",
                  f"  ingest (decode + apply): build {m['build_events_per_s']:,} events/s, churn "
                  f"{m['churn_events_per_s']:,}/s, overall {m['index_events_per_s']:,}/s "
                  f"({m['index_records_per_s']:,} records/s, {m['hashes_per_record']} hashes each; "
                  f"1-hash records: {m['single_hash_records_per_s']:,}/s)",
                  f"  kv_aware decision, {m['prompt_tokens']}-token prompt: p50 {m['decision_p50_ms']} ms, "
                  f"p99 {m['decision_p99_ms']} ms, max {m['decision_max_ms']} ms (load {m['load_1m']:.2f})",
                  f"  CPU time alone (what others' load on this machine cannot add): ingest "
                  f"{m['index_events_per_cpu_s']:,} events/s; decision p50 {m['decision_cpu_p50_ms']} ms, "
                  f"p99 {m['decision_cpu_p99_ms']} ms"]
    su = summary(result)
    goals = []
    if "hit_ratio_vs_rr" in su:
        goals.append(f"kv_aware / round_robin hit rate {su['hit_ratio_vs_rr']}x (goal >= 3x); "
                     f"TTFT p50 {su['ttft_p50_speedup_vs_rr']}x better (goal >= 2x)")
    if "index_events_per_s" in su:
        goals.append(f"ingest {su['index_events_per_s']:,} events/s (goal >= 500,000); decision p99 "
                     f"{su['decision_p99_ms']} ms (goal <= 0.5 ms)")
    return "\n".join(lines + ["vs goals: " + g for g in goals])


def report(result: dict, text: str) -> str:
    """The results as Markdown: the table, every replay run with the machine's load, the settings."""
    out = [f"# benchmarks/routing.py on this 2-core CPU\n\n```\n{text}\n```\n"]
    if result.get("replay"):
        out.append("| run | policy | hit rate | TTFT p50 s | TTFT p99 s | output tok/s | failed | prompt tokens per "
                   "worker | load (1 min) |\n|---|---|---|---|---|---|---|---|---|")
        for i, r in enumerate(result["replay"]["runs"]):
            out.append(f"| {i + 1} | {r['policy']} | {r['hit_rate']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} | "
                       f"{r['output_tok_s']} | {r['failed']} | {r['prompt_tokens_per_worker']} | {r['load_1m']:.2f} |")
    out.append(f"\nsettings: `{json.dumps(result['args'])}`\n")
    return "\n".join(out)


def summary(result: dict) -> dict:
    med = result.get("replay", {}).get("median", {})
    out: dict[str, Any] = {
        "hit_rate": {p: m["hit_rate"] for p, m in med.items() if p != "vllm_router"},
        "ttft_p50_s": {p: m["ttft_p50_s"] for p, m in med.items() if p != "vllm_router"},
        "ttft_p99_s": {p: m["ttft_p99_s"] for p, m in med.items() if p != "vllm_router"},
        "output_tok_s": {p: m["output_tok_s"] for p, m in med.items() if p != "vllm_router"},
    }
    if "vllm_router" in med:
        out["vllm_router_hit_rate"] = med["vllm_router"]["hit_rate"]
        out["vllm_router_ttft_p50_s"] = med["vllm_router"]["ttft_p50_s"]
    if "kv_aware" in med and "round_robin" in med:
        kv, rr = med["kv_aware"], med["round_robin"]
        out["hit_ratio_vs_rr"] = round(kv["hit_rate"] / rr["hit_rate"], 3) if rr["hit_rate"] else None
        out["ttft_p50_speedup_vs_rr"] = round(rr["ttft_p50_s"] / kv["ttft_p50_s"], 3) if kv["ttft_p50_s"] else None
    if result.get("micro"):
        m = result["micro"]
        out.update({k: m[k] for k in ("index_events_per_s", "index_events_per_cpu_s", "index_records_per_s",
                                      "single_hash_records_per_s", "decision_p50_ms", "decision_p99_ms",
                                      "decision_cpu_p99_ms")})
        out["micro_load_1m"] = m["load_1m"]
    out["goals"] = GOALS
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--micro-only", action="store_true", help="only the in-process index microbenchmark")
    p.add_argument("--replay-only", action="store_true", help="skip the index microbenchmark")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/routing_NAME.json and .md")
    p.add_argument("--append", action="store_true", help="with --save: add this run's replays to the file's (same "
                   "slice), or take its replays and measure only the microbenchmark again (--micro-only)")
    r = p.add_argument_group("replay")
    r.add_argument("--policies", default=",".join(POLICIES), help="comma-separated; kv_aware@W sets "
                   "router.kvAware.overlapWeight to W")
    r.add_argument("--vllm-router", metavar="PATH", default="", help="the vllm-router executable (its own venv)")
    r.add_argument("--trace", default="mooncake_conversation.jsonl")
    r.add_argument("--window-start", type=float, default=300.0, help="trace seconds")
    r.add_argument("--window-seconds", type=float, default=1200.0)
    r.add_argument("--sample", type=float, default=0.01, help="fraction of the window's conversations replayed")
    r.add_argument("--min-turns", type=int, default=2, help="replay conversations with at least this many turns "
                   "in the window (single-turn requests share only the system prompt, which every policy hits)")
    r.add_argument("--time-scale", type=float, default=0.2, help="multiplies the trace's inter-arrival times")
    r.add_argument("--max-input-len", type=int, default=2048)
    r.add_argument("--max-output-len", type=int, default=16)
    r.add_argument("--kv-cache-memory", default="720MiB", help="each worker's KV cache (splitserve up "
                   "--kv-cache-memory); 720MiB holds 16384 SmolLM2 tokens in fp32")
    r.add_argument("--slo-ttft", type=float, default=5.0)
    r.add_argument("--repeats", type=int, default=1)
    r.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("index microbenchmark")
    m.add_argument("--micro-blocks", type=int, default=1_000_000)
    m.add_argument("--micro-workers", type=int, default=64)
    m.add_argument("--micro-hashes-per-record", type=float, default=32.0, help="mean block hashes per stream entry")
    m.add_argument("--micro-single-records", type=int, default=100_000)
    m.add_argument("--micro-prompt-tokens", type=int, default=8192)
    m.add_argument("--micro-decisions", type=int, default=3000)
    p.add_argument("--strip-proxy", metavar="URL", help=argparse.SUPPRESS)  # internal: see strip_proxy
    p.add_argument("--proxy-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.strip_proxy:
        strip_proxy(args.strip_proxy, args.proxy_port)
        return

    result: dict[str, Any] = {"args": vars(args), "load_1m_start": os.getloadavg()[0]}
    saved = RESULTS / f"routing_{args.save}.json"
    old = json.loads(saved.read_text()) if args.save and args.append and saved.exists() else {}
    if not args.micro_only:
        result["replay"] = run_replay(args)
        if old.get("replay"):
            if old["replay"]["slice"] != result["replay"]["slice"]:
                raise SystemExit(f"--append: {saved} replayed another slice")
            result["replay"]["runs"] = old["replay"]["runs"] + result["replay"]["runs"]
    elif old.get("replay"):
        result["replay"] = old["replay"]
    if result.get("replay"):
        result["replay"]["median"] = medians(result["replay"]["runs"])
    if not args.replay_only:
        gc.collect()
        result["micro"] = run_micro(args)
    elif old.get("micro"):
        result["micro"] = old["micro"]
    result["summary"] = summary(result)
    text = table(result)
    print(text)
    if args.save:
        save(f"routing_{args.save}", result, report(result, text))
    if args.json:
        print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
