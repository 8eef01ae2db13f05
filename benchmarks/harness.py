"""What the benchmarks share: a serving cluster run as child processes of the benchmark (`Cluster`: `splitserve
up` or `serve-ray`; `PlacedCluster`: a gateway and workers started one by one on GPUs of their own), its metrics,
`splitserve bench` runs against it, trace slices, the random-weight model shapes, and the output every benchmark
ends with (a table, then one JSON line; result files under benchmarks/results/).

The scripts import it as `harness`: Python puts a script's own folder first on sys.path. It loads only the
standard library at import time (splitserve's helpers are imported where used), so every script can import it,
the GPU ones on a machine with nothing but torch and splitserve."""

from __future__ import annotations

import asyncio
import atexit
import csv
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRACES = Path(os.environ.get("SPLITSERVE_TRACES", ROOT.parent / "shared" / "traces"))  # the full traces
BIN = Path(sys.executable).parent  # the `splitserve` console script of this interpreter's environment
READY_S = 660.0  # s for `splitserve up` to be ready: past its own limit (600 s), so its own error is the one seen
STOP_S = 120.0  # s a cluster may take to drain and exit after SIGTERM, before SIGKILL


# -- output ----------------------------------------------------------------------------------------------------
def finish(text: str, line: dict[str, Any]) -> None:
    """What every benchmark ends with: its table, then one JSON line (the last line of stdout)."""
    print(text)
    print(json.dumps(line))


def save(stem: str, result: dict[str, Any], markdown: str | None = None) -> Path:
    """benchmarks/results/STEM.json, and STEM.md when `markdown` is given; the JSON file's path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{stem}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    if markdown is not None:
        (RESULTS / f"{stem}.md").write_text(markdown)
    return path


def report(title: str, command: str, text: str, result: dict[str, Any]) -> str:
    """The Markdown a run saves beside its JSON: a title, the command that ran (with its settings), the table,
    the JSON line."""
    return f"# {title}\n\n{command}\n\n{text}\n\n{json.dumps(result)}\n"


def ratio(num: dict[str, Any], den: dict[str, Any], key: str) -> float | None:
    """num[key] / den[key] to 3 decimals; None when either is missing (or den's is 0)."""
    return round(num[key] / den[key], 3) if den.get(key) and num.get(key) is not None else None


def out_path(name: str, out: str = "") -> Path:
    """Where a GPU benchmark writes its result file: --out (`out`) or benchmarks/results/NAME, moved under $OUT
    with the same file name when $OUT is set (the folder a device machine sends back)."""
    path = Path(out) if out else RESULTS / name
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def fmt(v: float | None, digits: int = 2, width: int = 0, thousands: bool = False) -> str:
    """A table cell, right-aligned in `width`: '-' for None, an int with thousands separators when `thousands`,
    else fixed-point with `digits` decimals."""
    if v is None:
        return f"{'-':>{width}}"
    if thousands and isinstance(v, int):
        return f"{v:>{width},}"
    return f"{v:>{width}.{digits}f}"


def markdown_table(first: str, runs: dict[str, dict[str, Any]], cols: Iterable[str]) -> list[str]:
    """Rows of a Markdown table: a run a row (its name under `first`), a column per key (floats as %g, None -)."""
    cols = list(cols)
    rows = [f"| {first} | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, r in runs.items():
        cells = ("-" if r.get(c) is None else f"{r[c]:g}" if isinstance(r[c], float) else str(r[c]) for c in cols)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def rounded(v: Any, digits: int = 4) -> Any:
    """`v` with every float in it rounded to `digits` decimals (dicts and lists walked)."""
    if isinstance(v, float):
        return round(v, digits)
    if isinstance(v, dict):
        return {k: rounded(x, digits) for k, x in v.items()}
    if isinstance(v, list):
        return [rounded(x, digits) for x in v]
    return v


# -- processes -------------------------------------------------------------------------------------------------
def process_tree(pid: int) -> set[int]:
    """`pid` and its descendants now (Linux /proc)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass  # the task ended while we read
    return out


def pss_bytes(pids: Iterable[int]) -> int:
    """Proportional set size of `pids` together (shared pages split between their users), bytes."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass  # gone meanwhile
    return total


def _start_time(pid: int) -> str | None:
    """When `pid` started (field 22 of /proc/PID/stat), which tells it from a later process given the same pid;
    None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def snapshot(pids: Iterable[int]) -> dict[int, str]:
    """The live ones of `pids`, each with its start time: what `kill_leftovers` may kill later."""
    return {pid: t for pid in pids if (t := _start_time(pid)) is not None}


def kill_leftovers(snap: dict[int, str], wait_s: float = 1.0) -> list[int]:
    """SIGKILL the processes of `snap` still alive `wait_s` from now; the pids killed."""
    deadline = time.monotonic() + wait_s
    while (alive := [p for p, t in snap.items() if _start_time(p) == t]) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass  # it exited in between
    return sorted(killed)


# -- HTTP and metrics ------------------------------------------------------------------------------------------
def http_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> None:
    """Poll `check` (connection errors and bad JSON count as not yet) until it is true; RuntimeError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, ValueError):
            pass  # not answering yet
        time.sleep(0.3)
    raise RuntimeError(f"timed out waiting for {what}")


def scrape(url: str, prefixes: tuple[str, ...] = ()) -> dict[str, float]:
    """The samples of URL/metrics, those whose name starts with one of `prefixes` (all when empty):
    {'name{labels}': value}."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if not line or line.startswith("#") or (prefixes and not line.startswith(prefixes)):
                continue
            key, _, value = line.rpartition(" ")
            out[key] = out.get(key, 0.0) + float(value)
    return out


def metric_total(samples: dict[str, float], name: str) -> float:
    """`name`'s samples in a `scrape`, summed over their labels."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


# -- a cluster as child processes ------------------------------------------------------------------------------
_LIVE: set[Cluster] = set()


@atexit.register
def _stop_live() -> None:
    """A cluster still running as the benchmark exits (an error escaped before its stop) is stopped here."""
    for cluster in list(_LIVE):
        cluster.stop()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)  # unwind: every `finally` and `with` stops its cluster


class Cluster:
    """`splitserve up` (or `serve-ray`: `command`) as a child process of the benchmark, ready once built: it
    printed its `splitserve ready` line (`up`: and its components line) and the gateway reports every worker
    healthy. `components` has the shape of `up`'s components line ({"router": URL, "prefill": [...],
    "decode": [...], "config", "redis", ...}, each worker with its name, grpc address, metrics URL and pid).

    Every process of a cluster runs in a session of its own (a Ctrl-C reaches the benchmark alone, which stops the
    cluster) and gets SIGTERM should the benchmark die, even by SIGKILL. `stop()` sends SIGTERM, SIGKILL after
    `stop_s` to what still runs, then SIGKILL to what their process trees left behind (`left_behind`). Each
    process logs to LOG_DIR/NAME-PROCESS.log (a fresh temporary folder unless `log_dir` is given)."""

    def __init__(self, *args: str, command: str = "up", file: Path | None = None, port: int | None = None,
                 env: dict[str, str] | None = None, timeout: float = READY_S, stop_s: float = STOP_S,
                 name: str | None = None, log_dir: Path | None = None) -> None:
        self._begin(name or command, log_dir, port, stop_s)
        cmd = [str(BIN / "splitserve"), command, *(["-f", str(file)] if file else []), *args, "--port", str(self.port)]
        self._awaiting = {"splitserve ready", "splitserve components"} if command == "up" else {"splitserve ready"}
        proc = self.spawn(command, cmd, env, pipe_stdout=True)
        threading.Thread(target=self._read_stdout, args=(proc.stdout,), daemon=True).start()
        self._wait_ready(timeout)

    def _begin(self, name: str, log_dir: Path | None, port: int | None, stop_s: float) -> None:
        from splitserve.common.proc import free_port

        self.name, self.stop_s = name, stop_s
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"splitserve-bench-{name}-"))
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.components: dict[str, Any] = {"router": self.url, "prefill": [], "decode": []}
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.left_behind: list[int] = []
        self.ready_s = 0.0
        self._awaiting: set[str] = set()  # line prefixes still to come on stdout before ready
        self._stdout: queue.Queue[str | None] = queue.Queue()
        self._logs: list[IO[str]] = []
        self._t0 = time.monotonic()
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        _LIVE.add(self)

    def log_path(self, process: str) -> Path:
        return self.log_dir / f"{self.name}-{process}.log"

    def spawn(self, process: str, cmd: list[str], env: dict[str, str] | None = None,
              pipe_stdout: bool = False) -> subprocess.Popen:
        """Start `cmd` as a process of this cluster (stopped with it), `env` added to ours; its output goes to
        its log (stdout to a pipe instead with `pipe_stdout`)."""
        from splitserve.common.proc import dying_with_me

        log = open(self.log_path(process), "w")
        self._logs.append(log)
        proc = subprocess.Popen(dying_with_me(cmd), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if pipe_stdout else log, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
        self.procs.append((process, proc))
        return proc

    def _read_stdout(self, stream: IO[str]) -> None:
        for line in stream:  # read to the end, so the process never blocks on a full pipe
            self._stdout.put(line)
        self._stdout.put(None)

    def _take_banner(self, wait_s: float) -> None:
        """Lines of the banner that came within `wait_s`: each awaited prefix seen, the components read."""
        try:
            while (line := self._stdout.get(timeout=wait_s)) is not None:
                wait_s = 0.0
                if line.startswith("splitserve components "):
                    self.components = json.loads(line.split(" ", 2)[2])
                self._awaiting = {p for p in self._awaiting if not line.startswith(p)}
        except queue.Empty:
            pass  # nothing more for now

    def _wait_ready(self, timeout: float) -> None:
        """Until the banner came and the gateway reports every worker healthy; stop() and raise should a
        process exit first or `timeout` pass (from the start)."""
        try:
            while True:
                if self._awaiting:
                    self._take_banner(0.5)
                gone = [(n, p) for n, p in self.procs if p.poll() is not None]
                if gone:
                    n, p = gone[0]
                    raise RuntimeError(f"{self.name}: {n} exited with code {p.returncode}:\n{self.log_tail(n)}")
                if not self._awaiting and self._healthy():
                    break
                if time.monotonic() - self._t0 > timeout:
                    raise TimeoutError(f"{self.name}: not ready in {timeout:.0f} s (logs in {self.log_dir})")
                if not self._awaiting:
                    time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - self._t0

    def _healthy(self) -> bool:
        try:
            return bool(http_json(self.url + "/health", timeout=5).get("all_healthy"))
        except (OSError, ValueError):
            return False  # the gateway is not listening yet

    def log_tail(self, process: str | None = None, lines: int = 30) -> str:
        """The last lines of a process's log (the first process's by default)."""
        path = self.log_path(process or self.procs[0][0])
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    # -- what it runs ------------------------------------------------------------------------------------------
    def pids(self) -> set[int]:
        """Every process of the cluster now, descendants included."""
        return set().union(*(process_tree(p.pid) for _, p in self.procs))

    def pss(self) -> int:
        return pss_bytes(self.pids())

    def worker_metrics(self, role: str, prefixes: tuple[str, ...] = ()) -> list[dict[str, float]]:
        """Each `role` worker's /metrics samples (`scrape`), in the components' order."""
        return [scrape(w["metrics"], prefixes) for w in self.components[role]]

    def metrics(self, *roles: str, prefixes: tuple[str, ...] = ()) -> dict[str, float]:
        """The samples of every worker of `roles` (prefill, decode) summed: {'name{labels}': value}."""
        out: dict[str, float] = {}
        for role in roles:
            for samples in self.worker_metrics(role, prefixes):
                for key, value in samples.items():
                    out[key] = out.get(key, 0.0) + value
        return out

    def stats(self, role: str = "decode") -> dict[str, dict[str, Any]]:
        """GET /stats of each `role` worker that answers, by name."""
        out = {}
        for w in self.components[role]:
            try:
                out[w["name"]] = http_json(w["metrics"] + "/stats")
            except (OSError, ValueError):
                pass  # a worker killed on purpose, or gone
        return out

    # -- stopping ----------------------------------------------------------------------------------------------
    def stop(self) -> float:
        """SIGTERM every process; SIGKILL (its whole session) any still running `stop_s` later; then SIGKILL
        whatever of their process trees is still alive a second after (`left_behind`). Seconds until the
        processes exited. Stopping again does nothing."""
        t0 = time.monotonic()
        tree = snapshot(self.pids())
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(max(0.1, t0 + self.stop_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it exited in between
                p.wait(10)
        took = time.monotonic() - t0
        self.left_behind += kill_leftovers(tree)
        for log in self._logs:
            log.close()
        _LIVE.discard(self)
        return took

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- a gateway and workers placed one by one -------------------------------------------------------------------
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTHONUNBUFFERED": "1"}
PLACED_READY_S = 900.0  # s for a placed cluster to be ready (imports, dummy weights, CUDA graphs)
# the handover's stage histograms, per worker role (docs/architecture.md, "The handover, stage by stage")
STAGE_METRICS = {"decode": "splitserve_handover_stage_seconds", "prefill": "splitserve_prefill_stage_seconds"}


class PlacedCluster(Cluster):
    """A gateway and workers started one by one, what `splitserve up` does not do: each worker on GPUs of its own
    (CUDA_VISIBLE_DEVICES) with flags of its own, random weights of `model`'s shape (`--load-format dummy`).
    `workers`: (role, GPU ids, extra flags) per worker; `args`: the GPU serving benchmarks' options (shape,
    device, max_model_len, kv_transport, disagg_threshold). `procs` lists the workers in order, then the gateway."""

    def __init__(self, args: Any, model: Path, mode: str, workers: list[tuple[str, list[int], list[str]]],
                 log_dir: Path, name: str, timeout: float = PLACED_READY_S, router_args: tuple[str, ...] = ()) -> None:
        from splitserve.common.proc import free_ports

        self._begin(name, log_dir, None, stop_s=30.0)
        exe = str(BIN / "splitserve")
        common = ["--model", str(model), "--served-model-name", args.shape, "--max-model-len", str(args.max_model_len)]
        ports = free_ports(2 * len(workers))
        planned = [(role, gpus, extra, ports[2 * i], ports[2 * i + 1]) for i, (role, gpus, extra) in enumerate(workers)]
        prefill = [f"127.0.0.1:{p}" for role, _, _, p, _ in planned if role == "prefill"]
        decode = [f"127.0.0.1:{p}" for role, _, _, p, _ in planned if role != "prefill"]
        for i, (role, gpus, extra, port, mport) in enumerate(planned):
            cmd = [exe, "worker", "--role", role, *common, "--load-format", "dummy", "--device", args.device,
                   "--port", str(port), "--metrics-port", str(mport), "--kv-transport", args.kv_transport,
                   "--tensor-parallel-size", str(max(1, len(gpus))), *extra]
            if role == "decode":
                cmd += ["--prefill-peers", ",".join(prefill), "--disagg-threshold", str(args.disagg_threshold)]
            env = dict(CHILD_ENV)
            if args.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            proc = self.spawn(f"{role}-{i}", cmd, env)
            self.components["prefill" if role == "prefill" else "decode"].append(
                {"name": f"{role}-{i}", "grpc": f"127.0.0.1:{port}", "metrics": f"http://127.0.0.1:{mport}",
                 "pid": proc.pid})
        self.spawn("router", [exe, "router", *common, "--mode", mode, "--port", str(self.port), "--decode",
                              ",".join(decode), "--prefill", ",".join(prefill), "--max-inflight", "1024",
                              *router_args], CHILD_ENV)
        self._wait_ready(timeout)
        print(f"[{self.name}] ready in {self.ready_s:.0f} s", file=sys.stderr, flush=True)

    def counters(self) -> dict[str, float]:
        """Where the decode workers' prompts were prefilled: remote (ok / failed) and local (by reason)."""
        return self.metrics("decode", prefixes=("splitserve_remote_prefill_total", "splitserve_local_prefill_total"))

    def stage_totals(self) -> dict[str, float]:
        """The handover's stage histograms' counts and sums, decode and prefill workers summed."""
        return self.metrics("decode", "prefill", prefixes=tuple(f"{name}_{part}" for name in STAGE_METRICS.values()
                                                                for part in ("count", "sum")))

    def kv_transports(self) -> list[str]:
        """What each worker's KV agent chose ("kv transport: nixl ..." in its log): auto falls back to tcp."""
        found = []
        for name, _ in self.procs:
            for line in self.log_path(name).read_text(errors="replace").splitlines():
                if "kv transport:" in line:
                    chosen = line.split("kv transport:", 1)[1].strip().rstrip('"}')  # the log line is JSON
                    found.append(f"{name}: {chosen}")
                    break
        return found


def stage_means_ms(before: dict[str, float], after: dict[str, float], early: bool | None = None) -> dict:
    """Mean milliseconds per stage between two `PlacedCluster.stage_totals`, per role, in the workers' stage
    order; `rpc_hops`: the prefill call's span on the decode worker less the prefill worker's stages (the gRPC
    round trip). The span is its `prefill` stage, and with `early` (the call out before the reservation, the
    default unless SPLITSERVE_PREFILL_EARLY=0) its `reserve` and `ticket` stages too."""
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


# -- random-weight model shapes --------------------------------------------------------------------------------
LLAMA8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "tie_word_embeddings": False,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                 "mlp_only_layers": []}
SHAPES = {  # what a served model's folder holds (model_dir): the shape and its end-of-sequence token
    "llama8b": {**LLAMA8B, "eos_token_id": 128001},
    "qwen3_30b_a3b": {**QWEN3_30B_A3B, "eos_token_id": 151645},
    # the CPU dry run: small enough for a 2-core machine, with 2 KV heads so TP=2 splits them
    "tiny": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
             "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
             "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 4096, "tie_word_embeddings": False, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "eos_token_id": 0},
}


def model_dir(shape: str, root: Path) -> Path:
    """ROOT/SHAPE: config.json of the shape and a word-level tokenizer of its vocabulary size (every id decodes
    to a visible token), so any shape is served with no files but its config."""
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


# -- requests --------------------------------------------------------------------------------------------------
def run_bench(url: str, *flags: str, model: str = "smollm2", timeout: float = 1800.0) -> dict[str, Any]:
    """One `splitserve bench --json` run against `url` with `flags`; its summary (its last line)."""
    res = subprocess.run([str(BIN / "splitserve"), "bench", "--url", url, "--model", model, *flags, "--json",
                          "--no-progress"], capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"splitserve bench failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_poisson(url: str, args: Any) -> dict[str, Any]:
    """Poisson arrivals at args.rate of args.requests fixed-length prompts (args.input_len, args.output_len)."""
    return run_bench(url, "--rate", str(args.rate), "--num-requests", str(args.requests), "--input-len",
                     str(args.input_len), "--output-len", str(args.output_len), "--seed", "1")


def bench_trace(url: str, trace: Path, n: int, args: Any) -> dict[str, Any]:
    """A Mooncake trace slice (`trace_slice`, written as JSON lines) replayed at args.time_scale, prompts clipped
    to args.max_input_len and outputs to args.max_output_len, TTFT SLO args.slo_ttft."""
    return run_bench(url, "--trace", str(trace), "--num-requests", str(n), "--time-scale", str(args.time_scale),
                     "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
                     "--slo-ttft", str(args.slo_ttft), "--slo-itl", "0.5", timeout=3600)


def warm_up(url: str) -> None:
    """Two concurrent short requests (their own random tokens, no shared prefix) so first-call costs stay out."""
    import random

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


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` random token ids below `vocab` (0 left out)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


async def sequential(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    """The prompts one after the other; `splitserve.bench`'s result of each."""
    import httpx

    from splitserve.bench import Job, one

    async with httpx.AsyncClient(timeout=600) as client:
        return [await one(client, url, model, Job(0.0, p, max_tokens)) for p in prompts]


def handover(url: str, args: Any) -> dict:
    """One request at a time on an idle cluster (fresh prompts: no prefix hits): TTFT and inter-token latency.
    args: shape, handover_requests, handover_len, handover_output."""
    vocab = SHAPES[args.shape]["vocab_size"]
    res = asyncio.run(sequential(url, args.shape, random_prompts(args.handover_requests, args.handover_len, vocab, 2),
                                 args.handover_output))
    ok = [r for r in res if r.ok]
    if not ok:
        raise RuntimeError(f"handover: every request failed: {res[0].error}")
    # the decode step as the client sees it: (last token - first token) / (tokens - 1), per request
    steps = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"ttft_ms": statistics.median(r.ttft for r in ok) * 1e3, "itl_ms": statistics.median(steps) * 1e3,
            "ttft_all_ms": [round(r.ttft * 1e3, 2) for r in ok]}


# -- traces ----------------------------------------------------------------------------------------------------
TRACE_FILES = {"azure_conv": "azure_conv_2023.csv", "azure_code": "azure_code_2023.csv"}


def _time_scale(trace_dir: Path, trace: str, n: int, rate: float) -> float:
    """--time-scale that replays the Azure trace's first n requests at `rate` requests/s on average."""
    with open(trace_dir / TRACE_FILES[trace]) as f:
        rows = [float(r["arrived_at"]) for _, r in zip(range(n), csv.DictReader(f), strict=False)]
    span = rows[-1] - rows[0]
    return (n - 1) / rate / span if span > 0 else 1.0


def replay_at_rate(args: Any, url: str, trace: str, rate: float, seed: int = 0,
                   duration: float | None = None, request_timeout: float = 300.0) -> dict:
    """An Azure trace (TRACE_FILES) replayed at `rate` requests/s for args.duration seconds (or `duration`), with
    the GPU serving benchmarks' options (shape, trace_dir, max_input_len, max_output_len, slo_ttft, slo_itl).
    `seed` picks the prompts' token ids: each run on a cluster takes its own, so a repeated rate meets a cold
    prefix cache as the first did (every mode runs the same seeds in the same order). A request that takes longer
    than `request_timeout` seconds counts as failed."""
    seconds = args.duration if duration is None else duration
    n = max(8, int(rate * seconds))
    res = run_bench(url, "--trace", str(args.trace_dir / TRACE_FILES[trace]), "--num-requests", str(n),
                    "--time-scale", f"{_time_scale(args.trace_dir, trace, n, rate):.6f}",
                    "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
                    "--slo-ttft", str(args.slo_ttft), "--slo-itl", str(args.slo_itl), "--vocab-low", "1",
                    "--vocab-high", str(SHAPES[args.shape]["vocab_size"]), "--seed", str(seed), "--timeout", f"{request_timeout:g}",
                    model=args.shape, timeout=seconds * 4 + 2 * request_timeout)
    res["offered_rps"] = rate
    return res


def conversation_key(row: dict, line: int) -> str:
    """A Mooncake conversation is named by its first own block (hash_ids[0] is the system prompt every request
    shares)."""
    ids = row["hash_ids"]
    return f"c{ids[1]}" if len(ids) > 1 else f"single{line}"


def _sampled(key: str, fraction: float, seed: int) -> bool:
    import hashlib

    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def trace_slice(path: Path, start_s: float, window_s: float, fraction: float, min_turns: int,
                seed: int) -> list[dict]:
    """Rows of whole Mooncake conversations (a `fraction` of them, by a stable hash) arriving in
    [start, start + window), keeping those with at least `min_turns` turns in the window."""
    from collections import Counter

    rows = []
    with open(path) as f:
        for line, text in enumerate(f):
            row = json.loads(text)
            t = row["timestamp"] / 1000.0
            key = conversation_key(row, line)
            if start_s <= t < start_s + window_s and _sampled(key, fraction, seed):
                rows.append((key, row))
    turns = Counter(key for key, _ in rows)
    return [row for key, row in rows if turns[key] >= min_turns]


def slice_stats(rows: list[dict], max_input: int) -> dict[str, Any]:
    """A slice's reuse, in prompt tokens (512-token hash blocks, clipped as the replay clips them): what an
    oracle with unbounded caches and perfect affinity could hit, and the part that is the system prompt
    (hash id 0, in every request: every worker holds it whatever the policy)."""
    from collections import Counter

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
