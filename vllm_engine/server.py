"""A stock vLLM OpenAI server for one worker: its command line and environment, derived from the cluster's model
and the role's engine settings (the one place they are translated, for local child processes and for the
operator's pods alike), and the child process `splitserve worker --engine vllm` runs beside itself locally.

The server is started as a module (`python -m vllm.entrypoints.openai.api_server`): the `vllm` console script of
some builds does not start. It listens on loopback only: its one client is the worker beside it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from splitserve.common.config import ClusterSpec, parse_memory
from splitserve.common.logs import relay_lines
from splitserve.common.proc import leading_group
from splitserve.vllm_engine.connectors import connector
from splitserve.vllm_engine.in_vllm.pool_plan import EXTRA_KEY as POOL_EXTRA_KEY
from splitserve.vllm_engine.in_vllm.pool_plan import REDIS_URL_ENV
from splitserve.vllm_engine.in_vllm.ucx_transport import LOG_DIR_ENV as UCX_LOG_DIR_ENV
from splitserve.vllm_engine.in_vllm.vllm_plugin import ENV as PROGRESS_DELAY_ENV

log = logging.getLogger("splitserve.vllm")
SERVER_LOG = logging.getLogger("splitserve.vllm.server")  # the server's own lines, relayed

EVENTS_TOPIC = "kv-events"

class VllmStartError(RuntimeError):
    """The vLLM server did not come up (exited, or not healthy in time); the message says which."""


class VllmPortTaken(VllmStartError):
    """The vLLM server exited because a port picked free for it was taken before it bound it (by another
    process's connection or listener): worth starting again on other ports."""


PORT_TAKEN = "Address already in use"  # the server's last words when a bind fails (EADDRINUSE)


@dataclass(frozen=True)
class VllmPorts:
    http: int  # its OpenAI API, /health and /metrics
    events: int  # its KV event publisher (ZMQ PUB)
    side_channel: int  # NIXL's handshake or metadata (disaggregated roles)
    control: int = 0  # the worker's line to the layerwise connector (ZMQ, loopback)


def is_cpu(spec: ClusterSpec) -> bool:
    """Whether the role's vLLM runs on CPU: device cpu, or auto on a host without an NVIDIA GPU."""
    device = spec.model.device
    return device == "cpu" or (device == "auto" and not Path("/dev/nvidia0").exists())


def cpu_binding(slot: int, slots: int, ranks: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for the `slot`-th of `slots` vLLM CPU servers on one host: cores of its own, split
    among its `ranks` tensor-parallel ranks (with more servers than cores, a core per rank, servers taking turns);
    None when there are fewer cores than ranks on the host. (vLLM binds
    every server's OpenMP threads to all of a NUMA node's cores; two servers' threads on the same cores wait on
    each other's barriers: 1P+1D on 2 cores took 21 s for 12 tokens, against under 2 s bound apart.)"""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return None
    if len(cores) < slots * ranks:  # more servers than cores: each gets ranks cores of its own, shared round-robin
        start = slot * ranks % (len(cores) - len(cores) % ranks)
        return "|".join(str(cores[start + r]) for r in range(ranks))
    per = len(cores) // (slots * ranks)
    start = slot % slots * per * ranks
    return "|".join(",".join(str(c) for c in cores[start + r * per:start + (r + 1) * per]) for r in range(ranks))


def process_env(spec: ClusterSpec, role: str, slot: int, slots: int) -> dict[str, str] | None:
    """A worker process's environment for the `slot`-th of `slots` workers a host starts on one machine: on CPU,
    its server's OpenMP threads on cores of its own (`cpu_binding`), unless VLLM_CPU_OMP_THREADS_BIND is set
    already."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or not is_cpu(spec):
        return None
    ranks = spec.model.tensor_parallel_size * spec.role(role).engine.data_parallel_size
    binding = cpu_binding(slot, slots, ranks)
    return {"VLLM_CPU_OMP_THREADS_BIND": binding} if binding else None


def inline_cores(spec: ClusterSpec, role: str) -> list[int] | None:
    """The cores of a local vLLM CPU server that runs its model in its engine-core process (vLLM's `uni` executor)
    rather than in a third process: on CPU, one rank, and this worker's binding (`process_env`) one list of cores.
    vLLM's CPU mode spawns that process only to bind its OpenMP threads, and the spawn imports vLLM once more
    (10 of the 28 s a server took to start on 2 cores); the binding is then made here instead: the server's CPU
    affinity and OMP_NUM_THREADS (`environment`, `VllmServer.start`). None: vLLM's own mode."""
    if not is_cpu(spec) or spec.model.tensor_parallel_size * spec.role(role).engine.data_parallel_size != 1:
        return None
    return parse_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))


def parse_cores(binding: str) -> list[int] | None:
    """The cores one VLLM_CPU_OMP_THREADS_BIND list names ("0,1", "0-3,8"); None for "", "all", "nobind" or one
    list per rank ("0|1")."""
    cores: list[int] = []
    for part in binding.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or not (last if dash else first).isdigit():
            return None
        cores += range(int(first), int(last if dash else first) + 1)
    return cores or None


def disaggregated(spec: ClusterSpec, role: str) -> bool:
    return role in ("prefill", "decode") and spec.mode == "disaggregated"


def _kv_size(text: str) -> int | float:
    """`engine.kvCacheMemory` (not auto) as bytes (an int over 1) or a share of memory (a float), read by the
    configuration model's parser; "1" is the whole share, as the configuration model documents it."""
    value = parse_memory(text)
    return float(text) if isinstance(value, int) and value <= 1 else value


def command(spec: ClusterSpec, role: str, model: str, ports: VllmPorts, python: str = sys.executable,
            pool_identity: tuple[str, str] | None = None) -> list[str]:
    """The vLLM server's command line for a worker of `role` (prefill, decode or both). `model`: the model
    directory as the server sees it. Its KV event publisher connects to the worker's loopback port (vLLM binds
    only wildcard endpoints; the worker binds this one). `pool_identity`: see `pool_extra_config`."""
    m, e = spec.model, spec.role(role).engine
    # -P: the working directory stays off sys.path (a checkout's source folder would shadow the installed
    # splitserve that vLLM imports our connectors and plugin from)
    cmd = [python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", m.served_name, "--host", "127.0.0.1", "--port", str(ports.http),
           "--dtype", "float32" if m.dtype == "auto" and is_cpu(spec) else m.dtype, "--block-size", str(m.block_size),
           "--tensor-parallel-size", str(m.tensor_parallel_size),
           "--max-num-seqs", str(e.max_num_seqs), "--max-num-batched-tokens", str(e.max_num_batched_tokens),
           "--scheduling-policy", e.scheduling_policy, "--seed", str(e.seed),
           "--enable-prompt-tokens-details"]
    cmd.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    if m.max_model_len:
        cmd += ["--max-model-len", str(m.max_model_len)]
    if e.long_prefill_token_threshold:
        cmd += ["--long-prefill-token-threshold", str(e.long_prefill_token_threshold)]
    if e.data_parallel_size > 1:
        cmd += ["--data-parallel-size", str(e.data_parallel_size)]
    if m.expert_parallel:
        cmd.append("--enable-expert-parallel")
    if m.load_format == "dummy":
        cmd += ["--load-format", "dummy"]
    # On CPU vLLM's start-up compilation takes minutes (13-15 on 2 cores): run eagerly there.
    if m.enforce_eager or is_cpu(spec):
        cmd.append("--enforce-eager")
    if e.kv_cache_memory != "auto":
        size = _kv_size(e.kv_cache_memory)
        if isinstance(size, float):  # a share (on CPU vLLM reads it as the share of host memory)
            cmd += ["--gpu-memory-utilization", str(size)]
        elif not is_cpu(spec):  # on CPU, bytes go in VLLM_CPU_KVCACHE_SPACE (`environment`)
            cmd += ["--kv-cache-memory-bytes", str(size)]
    cmd += ["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ports.events}",
        "topic": EVENTS_TOPIC})]
    transfer = kv_transfer_config(spec, role, pool_identity, ports.control)
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    if inline_cores(spec, role):
        cmd += ["--distributed-executor-backend", "uni"]
    return cmd + list(spec.vllm.args) + list(spec.role(role).engine.vllm_args)


def kv_transfer_config(spec: ClusterSpec, role: str, pool_identity: tuple[str, str] | None = None,
                       control_port: int = 0) -> dict | None:
    """vLLM's KV connectors for the role: the handover's (disaggregated roles, `vllm.connector`: `connectors`),
    our KV pool connector (`kvPool.enabled`), or both in a MultiConnector (the handover's first: a remote prefill's
    KV wins). A load that fails is recomputed by vLLM, never an error."""
    connectors = []
    if disaggregated(spec, role):
        connectors.append(connector(spec).entry(spec, is_cpu(spec), control_port or spec.vllm.control_port))
    if spec.kv_pool.enabled:
        connectors.append({"kv_connector": "SplitservePoolConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "splitserve.vllm_engine.in_vllm.pool_connector",
                           "kv_connector_extra_config": pool_extra_config(spec, role, pool_identity)})
    if not connectors:
        return None
    if len(connectors) == 1:
        return {**connectors[0], "kv_load_failure_policy": "recompute"}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": connectors}}


def needs_connector_files(spec: ClusterSpec, role: str) -> bool:
    """Whether the role's vLLM server imports one of splitserve's connectors (a stock vLLM image needs their files
    copied beside it: `connector_files`)."""
    return spec.kv_pool.enabled or (disaggregated(spec, role) and connector(spec).name == "layerwise")


def pool_extra_config(spec: ClusterSpec, role: str, identity: tuple[str, str] | None) -> dict:
    """The pool connector's settings (`pool_plan.PoolSettings`). `identity`: the (name, instance id) its pool
    events and stats carry, chosen by the worker that starts the server; None where the server is rendered
    before its worker exists (a pod: the connector then names itself after its host)."""
    p = spec.kv_pool
    settings = {"model": spec.model.served_name, "write": ("decode" if role == "both" else role) in p.write_from,
                "min_load_tokens": p.min_load_tokens, "read_timeout_seconds": p.read_timeout_seconds,
                "lookup_timeout_seconds": p.lookup_timeout_seconds,
                "write_queue_blocks": p.write_queue_blocks, "ttl_seconds": p.ttl_seconds}
    if identity is not None:
        settings["worker"], settings["instance_id"] = identity
    return {POOL_EXTRA_KEY: settings}


def environment(spec: ClusterSpec, role: str, ports: VllmPorts, side_channel_host: str) -> dict[str, str]:
    """Environment variables the server needs beyond the worker's own."""
    env: dict[str, str] = {}
    e = spec.role(role).engine
    if is_cpu(spec):
        # vLLM on CPU sizes its KV cache in whole GiB; auto is 1 GiB (its own default reserves 92% of the host's
        # memory, which a second server on the same machine cannot get)
        size = _kv_size(e.kv_cache_memory) if e.kv_cache_memory != "auto" else 1 << 30
        if isinstance(size, int):
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(size / (1 << 30))))
        cores = inline_cores(spec, role)
        if cores:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # lets the CPU platform keep the `uni` executor
            if "OMP_NUM_THREADS" not in os.environ:
                env["OMP_NUM_THREADS"] = str(len(cores))
    elif spec.model.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = spec.model.device.split(":", 1)[1]
    if e.batch_invariant:
        if is_cpu(spec):  # device auto on a host without a GPU (device cpu is refused by the configuration model)
            raise VllmStartError(f"{role}.engine.batchInvariant: vLLM's batch-invariant mode runs on GPUs only, and "
                                 f"this host has none; use engine native on CPU")
        env["VLLM_BATCH_INVARIANT"] = "1"
    url = spec.redis.resolved_url()
    if spec.kv_pool.enabled and url and REDIS_URL_ENV not in os.environ:  # the pool connector's Redis
        env[REDIS_URL_ENV] = url
    if disaggregated(spec, role):
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = side_channel_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ports.side_channel)
        # UCX over TCP on CPU (its shared-memory transports hung a second server's NIXL start on one host) or
        # when asked; loopback when the handshake is on loopback. Values set by the operator's env win.
        if (is_cpu(spec) or spec.kv_transfer.backend == "tcp") and "UCX_TLS" not in os.environ:
            env["UCX_TLS"] = "tcp,self"
        if side_channel_host in ("127.0.0.1", "localhost") and "UCX_NET_DEVICES" not in os.environ:
            env["UCX_NET_DEVICES"] = "lo"
        if is_cpu(spec) and PROGRESS_DELAY_ENV not in os.environ:  # vllm_plugin: an idle server spins no core
            env[PROGRESS_DELAY_ENV] = "1000"
        if connector(spec).control and UCX_LOG_DIR_ENV not in os.environ:  # UCX's transport tables, per process
            env[UCX_LOG_DIR_ENV] = f"/tmp/splitserve-ucx-{ports.http}"
    return env


class VllmServer:
    """A vLLM server as this worker's child, in a process group of its own led by a small shim
    (`leading_group`): its engine core processes are stopped with it, and when this process dies (even by
    SIGKILL) the whole group gets SIGTERM, then SIGKILL after `stop_grace_s` (a server still loading its model
    does not stop on SIGTERM)."""

    def __init__(self, cmd: list[str], env: dict[str, str], url: str, startup_s: float,
                 output: IO[str] | None = None, cores: list[int] | None = None, stop_grace_s: float = 30.0) -> None:
        self.cmd, self.env, self.url, self.startup_s = cmd, env, url, startup_s
        self.output = output  # where its stdout and stderr go (None: this process's)
        self.cores = cores  # its CPU affinity (`inline_cores`; None: inherited)
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen | None = None  # the shim that leads the server's process group
        self.last_lines: deque[str] = deque(maxlen=50)  # its output's last lines (when relayed)
        self._relays: list[threading.Thread] = []

    def start(self) -> None:
        """Start the server. Without `output`, its lines become this process's JSON log lines (logger
        `splitserve.vllm`, at the level each line names; unlabelled lines: info from stdout, warning from stderr)."""
        log.info("starting vLLM: %s", " ".join(self.cmd))
        relay = self.output is None
        self.proc = subprocess.Popen(leading_group(self.cmd, self.stop_grace_s, self.cores),
                                     env={**os.environ, **self.env}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE if relay else self.output,
                                     stderr=subprocess.PIPE if relay else subprocess.STDOUT,
                                     text=True, errors="replace", start_new_session=True)
        if relay:
            assert self.proc.stdout is not None and self.proc.stderr is not None
            self._relays = [relay_lines(self.proc.stdout, SERVER_LOG, logging.INFO, self.last_lines),
                            relay_lines(self.proc.stderr, SERVER_LOG, logging.WARNING, self.last_lines)]

    @property
    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_healthy(self, stop: object = None) -> None:
        """Until GET /health answers 200; raises `VllmStartError` if the server exits first or takes longer than
        its startup limit. `stop`: an object with `is_set()`; when set, gives up (raises) at once."""
        deadline = time.monotonic() + self.startup_s
        while True:
            code = self.exited
            if code is not None:
                for relay in self._relays:  # its last lines
                    relay.join(2)
                if any(PORT_TAKEN in line for line in self.last_lines):
                    raise VllmPortTaken(f"the vLLM server exited with code {code} while starting: a port picked "
                                        f"for it was taken before it could bind it ({PORT_TAKEN})")
                raise VllmStartError(f"the vLLM server exited with code {code} while starting (its log is above)")
            if stop is not None and stop.is_set():  # type: ignore[attr-defined]
                raise VllmStartError("stopped while the vLLM server was starting")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise VllmStartError(f"the vLLM server did not answer {self.url}/health within "
                                     f"{self.startup_s:.0f} s (vllm.startupSeconds)")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after `stop_grace_s`; then remove the files it left for
        us (UCX's transport tables)."""
        try:
            self._stop(self.stop_grace_s)
        finally:
            if self.env.get(UCX_LOG_DIR_ENV):
                shutil.rmtree(self.env[UCX_LOG_DIR_ENV], ignore_errors=True)

    def _stop(self, grace_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s + 10)  # the shim kills what is left of the group after grace_s itself
        except subprocess.TimeoutExpired:
            log.warning("vLLM server did not stop within %.0f s: killing it", grace_s + 10)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
