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
import hashlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.common.proc import free_port
from splitserve.common.redis_wire import KVEventRecord
from splitserve.router.kv_index import KVIndex
from splitserve.router.policy import KVAware, RequestFeatures, WorkerLoad

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRACES = Path(os.environ.get("SPLITSERVE_TRACES", ROOT.parent / "shared" / "traces"))
BIN = Path(sys.executable).parent
POLICIES = ("kv_aware", "round_robin", "least_loaded")
GOALS = {"hit_ratio_vs_rr": 3.0, "ttft_p50_speedup_vs_rr": 2.0, "index_events_per_s": 500_000, "decision_p99_ms": 0.5}


# -- the replay's requests -------------------------------------------------------------------------------------
def conversation_key(row: dict, line: int) -> str:
    """A conversation is named by its first own block (hash_ids[0] is the system prompt every request shares)."""
    ids = row["hash_ids"]
    return f"c{ids[1]}" if len(ids) > 1 else f"single{line}"


def sampled(key: str, fraction: float, seed: int) -> bool:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def trace_slice(path: Path, start_s: float, window_s: float, fraction: float, min_turns: int,
                seed: int) -> list[dict]:
    """Rows of whole conversations (a `fraction` of them, by a stable hash) arriving in [start, start + window),
    keeping those with at least `min_turns` turns in the window."""
    rows = []
    with open(path) as f:
        for line, text in enumerate(f):
            row = json.loads(text)
            t = row["timestamp"] / 1000.0
            key = conversation_key(row, line)
            if start_s <= t < start_s + window_s and sampled(key, fraction, seed):
                rows.append((key, row))
    turns = Counter(key for key, _ in rows)
    return [row for key, row in rows if turns[key] >= min_turns]


def slice_stats(rows: list[dict], max_input: int) -> dict[str, Any]:
    """The slice's reuse, in prompt tokens (512-token hash blocks, clipped as the replay clips them): what an
    oracle with unbounded caches and perfect affinity could hit, and the part that is the system prompt
    (hash id 0, in every request: every worker holds it whatever the policy)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = system = 0
    turns = Counter(conversation_key(r, i) for i, r in enumerate(rows))  # (single-turn rows: one each)
    for r in rows:
        n = min(r["input_length"], max_input)
        ids = r["hash_ids"][: -(-n // 512)]
        k = 0
        while k < len(ids) and tuple(ids[: k + 1]) in seen:
            k += 1
        hit += min(k * 512, n - 1)
        total += n
        system += min(512, n - 1)
        seen.update(tuple(ids[: i + 1]) for i in range(len(ids)))
    return {"requests": len(rows), "conversations": len(turns),
            "multi_turn_conversations": sum(1 for c in turns.values() if c > 1), "prompt_tokens": total,
            "oracle_hit_rate": round(hit / total, 4), "system_prompt_share": round(system / total, 4)}


# -- processes -------------------------------------------------------------------------------------------------
def http_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"timed out waiting for {what}")


class Cluster:
    """`splitserve up` as a child process; `components` is its `splitserve components {...}` line."""

    def __init__(self, *args: str, timeout: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr: list[str] = []
        self.proc = subprocess.Popen([str(BIN / "splitserve"), "up", "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.components: dict = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.match(r"splitserve components (.*)", line)
            if m:
                self.components = json.loads(m.group(1))
                break
        if not self.components:
            self.stop()
            raise RuntimeError("splitserve up did not start:\n" + "".join(self.stderr[-20:]))

    def worker_counters(self) -> list[tuple[float, float]]:
        """(prefix-hit tokens, prompt tokens) of each worker, from its own /metrics."""
        out = []
        for w in self.components["decode"]:
            with urllib.request.urlopen(w["metrics"] + "/metrics", timeout=10) as r:
                text = r.read().decode()
            values = {"splitserve_worker_prefix_hit_tokens_total": 0.0, "splitserve_worker_prompt_tokens_total": 0.0}
            for line in text.splitlines():
                name, _, value = line.rpartition(" ")
                if name in values:
                    values[name] += float(value)
            out.append((values["splitserve_worker_prefix_hit_tokens_total"],
                        values["splitserve_worker_prompt_tokens_total"]))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def gateway_hit_tokens(url: str) -> float:
    """The gateway's splitserve_router_prefix_hit_tokens_total: prompt tokens its decisions expected cached."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("splitserve_router_prefix_hit_tokens_total "):
                return float(line.split()[-1])
    return 0.0


def start_process(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def bench(url: str, trace: Path, n: int, args: argparse.Namespace) -> dict:
    cmd = [str(BIN / "splitserve"), "bench", "--url", url, "--model", "smollm2", "--trace", str(trace),
           "--num-requests", str(n), "--time-scale", str(args.time_scale), "--max-input-len", str(args.max_input_len),
           "--max-output-len", str(args.max_output_len), "--slo-ttft", str(args.slo_ttft), "--slo-itl", "0.5",
           "--json", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"splitserve bench failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def warm_up(url: str) -> None:
    """Two concurrent short requests (their own random tokens, no shared prefix) so first-call costs stay out."""
    rng = random.Random(12345)
    bodies = [json.dumps({"model": "smollm2", "prompt": [rng.randrange(1000, 30000) for _ in range(48)],
                          "max_tokens": 2}).encode() for _ in range(2)]

    def post(body: bytes) -> None:
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=300).read()

    threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def replay_once(policy: str, trace: Path, n: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One fresh cluster, one replay: the policy's hit rate and the bench's summary. `policy` is a splitserve
    policy, or `vllm_router` (cache_aware in front of one static gateway per worker)."""
    routing, _, weight = ("round_robin" if policy == "vllm_router" else policy).partition("@")
    flags = []
    if weight:  # kv_aware@W: router.kvAware.overlapWeight W
        doc = workdir / f"overlap-{weight}.yaml"
        doc.write_text("apiVersion: splitserve.dev/v1alpha1\nkind: SplitServeCluster\nmetadata: {name: routing-bench}\n"
                       f"spec:\n  router: {{kvAware: {{overlapWeight: {float(weight)}}}}}\n")
        flags = ["-f", str(doc)]
    cluster = Cluster(*flags, "--mode", "colocated", "--decode", "2", "--routing", routing,
                      "--kv-cache-memory", args.kv_cache_memory)
    extra: list[subprocess.Popen] = []
    try:
        url = cluster.url
        if routing == "kv_aware":
            wait_until(lambda: http_json(url + "/health")["index"]["usable"], 60, "the KV index")
        if policy == "vllm_router":
            url = front_with_vllm_router(cluster, args, workdir, extra)
        warm_up(url)
        before, expected = cluster.worker_counters(), gateway_hit_tokens(cluster.url)
        summary = bench(url, trace, n, args)
        after, expected = cluster.worker_counters(), gateway_hit_tokens(cluster.url) - expected
    finally:
        for p in reversed(extra):
            stop_process(p)
        cluster.stop()
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


def front_with_vllm_router(cluster: Cluster, args: argparse.Namespace, workdir: Path,
                           extra: list[subprocess.Popen]) -> str:
    """One splitserve gateway per worker (static membership from the cluster's effective config), each behind a
    proxy that drops the fields vllm-router adds, and vllm-router's cache_aware policy over them. Returns
    vllm-router's URL."""
    gateways = []
    for w in cluster.components["decode"]:
        port, proxy = free_port(), free_port()
        extra.append(start_process([str(BIN / "splitserve"), "router", "--config", cluster.components["config"],
                                    "--decode", w["grpc"], "--mode", "colocated", "--routing", "least_loaded",
                                    "--port", str(port)], workdir / f"gateway-{w['name']}.log"))
        extra.append(start_process([sys.executable, __file__, "--strip-proxy", f"http://127.0.0.1:{port}",
                                    "--proxy-port", str(proxy)], workdir / f"proxy-{w['name']}.log"))
        gateways.append(f"http://127.0.0.1:{proxy}")
    for g in gateways:
        wait_until(lambda g=g: http_json(g + "/health")["all_healthy"], 120, f"gateway {g}")
    port = free_port()
    extra.append(start_process([args.vllm_router, "--worker-urls", *gateways, "--policy", "cache_aware",
                                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                               workdir / "vllm-router.log"))
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
def _fmt(v: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


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
            lines.append(f"{policy:<14}{_fmt(m['hit_rate'], 10, 3)}{_fmt(m['ttft_p50_s'], 10, 2)}"
                         f"{_fmt(m['ttft_p99_s'], 10, 2)}{_fmt(m['output_tok_s'], 8, 2)}{_fmt(m['request_rps'], 8, 3)}"
                         f"{m['failed']:>8}{_fmt(m['load_1m'], 7, 2)}{m['repeats']:>6}")
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
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"routing_{args.save}.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / f"routing_{args.save}.md").write_text(report(result, text))
    if args.json:
        print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
