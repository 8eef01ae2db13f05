"""The local actuator of the SLO control law (`splitserve up --autoscale`): every `autoscaling.intervalSeconds`
the shared `Autoscaler` observes the cluster (the bundled Redis registry, the gateways' and workers' /metrics)
and calls the law; this module applies the decision to worker processes on this machine. Role flips first (the
decision's `flip`: the least loaded workers of its source role are asked to serve the other one, over their
gRPC, and count in their new pool from then on); then scale-up starts workers and scale-down drains them
(SIGTERM: the worker marks itself draining in the registry, finishes its requests in flight and exits; never
SIGKILL). The decision metrics are served on a port of the launcher's own
(`components.autoscaler.metrics`). Before any worker starts, the workers of all roles together are bounded by
what this machine holds (`local_bound`: its cores and available memory), which the law gets as its budget.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import start_http_server

from splitserve.autoscaler.actuator import Autoscaler, default_profile, load_profile
from splitserve.autoscaler.flips import RoleFlip
from splitserve.autoscaler.law import ROLES, ScalingDecision
from splitserve.autoscaler.observer import Observer
from splitserve.common.config import ClusterResource, ClusterSpec
from splitserve.common.model_files import ModelNotFoundError, resolve_model
from splitserve.common.proc import usable_cores
from splitserve.hosts.common import flip_candidates, flip_workers

log = logging.getLogger("splitserve.autoscaler.local")

# A worker process beyond its weights and KV cache: Python, torch, gRPC, the tokenizer, allocator slack. Measured
# on SmolLM2-135M float32 with 512 MiB of KV: 1.74 GiB resident after serving, of which 0.50 GiB weights.
WORKER_RUNTIME_BYTES = 800 << 20
GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 512 << 20  # what kvCacheMemory auto gives on a CPU (engine/loading.py)
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "BOOL": 1}


@dataclass(frozen=True)
class Machine:
    """What this machine offers worker processes."""

    cores: int  # CPUs this process may run on
    available_bytes: int  # memory available to new processes (MemAvailable)

    @classmethod
    def here(cls) -> Machine:
        cores = usable_cores()
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        try:
            with open("/proc/meminfo") as f:  # MemAvailable counts reclaimable page cache, as the kernel does
                for line in f:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) * 1024
        except OSError:
            pass
        return cls(cores, available)


@dataclass(frozen=True)
class LocalBound:
    """The most worker processes (all roles) `up --autoscale` may run at once here, and why."""

    workers: int
    reason: str  # one line: the numbers it came from and the limit that applied

    def budget(self, spec: ClusterSpec) -> int:
        """The bound as the law's budget (replicas x tensorParallelSize)."""
        return self.workers * spec.model.tensor_parallel_size


def weight_bytes(spec: ClusterSpec) -> int:
    """Bytes of the model's weights in a worker: parameters (from the safetensors headers) x the dtype it runs
    in (auto: float32 on a CPU). 0 when the files cannot be read (dummy weights of an unknown size)."""
    try:
        model_dir = resolve_model(spec.model.name, need_weights=spec.model.load_format != "dummy")
    except ModelNotFoundError:
        return 0
    dtype = spec.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if spec.model.device.startswith("cuda") else "float32"
    params, stored = 0, 0
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in t["shape"]:
                count *= dim
            params += count
            stored += count * DTYPE_BYTES.get(t["dtype"], 4)
    return params * (4 if dtype == "float32" else 2) if params else stored


def kv_bytes(spec: ClusterSpec) -> int:
    """The larger of the two roles' KV cache settings, in bytes (auto and fractions: the CPU default)."""
    from splitserve.common.config import parse_memory

    sizes = [parse_memory(r.engine.kv_cache_memory) if r.engine.kv_cache_memory != "auto" else CPU_DEFAULT_KV_BYTES
             for r in (spec.prefill, spec.decode)]
    return max(s if isinstance(s, int) else CPU_DEFAULT_KV_BYTES for s in sizes)


def worker_memory_bytes(spec: ClusterSpec) -> int:
    """A conservative estimate of one worker process's resident memory."""
    return weight_bytes(spec) + kv_bytes(spec) + WORKER_RUNTIME_BYTES


def local_bound(spec: ClusterSpec, machine: Machine, per_worker_bytes: int) -> LocalBound:
    """The most workers this machine holds: memory (available now, 90% of it, over a worker's estimated size)
    always; cores (one worker per core: more only time-share the same cores) unless `autoscaling.gpuBudget`
    is set, which then replaces the core bound. Never below the replicas asked for at start."""
    mem_workers = int(0.9 * machine.available_bytes) // max(1, per_worker_bytes)
    budget = spec.autoscaling.gpu_budget
    cpu_workers = machine.cores if budget is None else budget // spec.model.tensor_parallel_size
    cpu_what = f"{machine.cores} cores" if budget is None else f"autoscaling.gpuBudget {budget}"
    start = spec.decode.replicas + (spec.prefill.replicas if spec.mode == "disaggregated" else 0)
    workers, limit = (mem_workers, "memory") if mem_workers < cpu_workers else (cpu_workers, cpu_what)
    if workers < start:
        workers, limit = start, "the replicas asked for at start"
    reason = (f"at most {workers} workers on this machine ({cpu_what}, {machine.available_bytes / GiB:.1f} GiB "
              f"available, ~{per_worker_bytes / GiB:.1f} GiB per worker): bound by {limit}")
    return LocalBound(workers, reason)


class Launcher(Protocol):
    """What the actuator needs of the launcher that owns the processes (`launcher.Launcher`)."""

    resource: ClusterResource
    host: str
    components: dict[str, Any]

    def workers(self, role: str) -> list[str]: ...  # names of the role's running, not draining, workers
    def add_worker(self, role: str) -> str: ...
    def drain_worker(self, name: str) -> None: ...
    def moved(self, name: str, role: str) -> None: ...  # a flipped worker serves `role` now


class LocalAutoscaler:
    def __init__(self, launcher: Launcher, autoscaler: Autoscaler, observer: Observer) -> None:
        self.launcher = launcher
        self.autoscaler = autoscaler
        self.observer = observer

    @classmethod
    def bound(cls, launcher: Launcher, machine: Machine | None = None) -> LocalBound:
        """Before any worker starts: cap the launcher's cluster at what this machine holds (the law's budget),
        and say so in one log line."""
        spec = launcher.resource.spec
        bound = local_bound(spec, machine or Machine.here(), worker_memory_bytes(spec))
        spec.autoscaling.gpu_budget = bound.budget(spec)
        launcher.components["autoscaler"] = {"max_workers": bound.workers, "bound": bound.reason}
        log.info("autoscaler: %s", bound.reason)
        return bound

    @classmethod
    def for_launcher(cls, launcher: Launcher, profile: str | Path | None = None) -> LocalAutoscaler:
        """The law for the launcher's cluster, its metrics served on a free port (listed in its components)."""
        resource = launcher.resource
        spec = resource.spec
        path = Path(profile) if profile else default_profile(spec)
        replica_profile = load_profile(path)  # ValueError: one line, the launcher stops
        routers = launcher.components["routers"]
        observer = Observer(spec.redis.resolved_url(), spec.model.served_name,
                            lambda: [r["url"] for r in routers], colocated=spec.mode == "colocated")
        scaler = Autoscaler(resource.metadata.name, spec, observer, replica_profile)
        port = launcher.free_port()
        start_http_server(port, addr=launcher.host)
        launcher.components.setdefault("autoscaler", {}).update(metrics=f"http://{launcher.host}:{port}",
                                                                 profile=str(path))
        log.info("autoscaler on: every %g s, profile %s, metrics http://%s:%d/metrics",
                 spec.autoscaling.interval_seconds, path, launcher.host, port)
        return cls(launcher, scaler, observer)

    def expected(self) -> dict[str, int]:
        """Worker processes asked for per pool (running, not draining)."""
        return {role: len(self.launcher.workers(role)) for role in ROLES}

    def tick(self) -> ScalingDecision | None:
        """Observe, decide and apply when an interval has passed. A failure here is logged and the cluster keeps
        serving with the replicas it has (the autoscaler must never take the cluster down)."""
        try:
            decision = self.autoscaler.tick(self.expected())
            if decision is not None:
                self.apply(decision)
            return decision
        except Exception:
            log.exception("autoscaler: this interval's decision failed; replicas unchanged")
            return None

    def apply(self, decision: ScalingDecision) -> None:
        """Flip workers as the decision says, then start or drain workers until each pool has the decided number
        of processes (a flip that failed leaves its worker in its pool: a start makes up for it)."""
        if decision.flip is not None:
            self.flip(decision.flip)
        for role in ROLES:
            running = self.launcher.workers(role)
            want = getattr(decision, role).desired
            for _ in range(want - len(running)):
                name = self.launcher.add_worker(role)
                log.info("autoscaler: started %s", name, extra={"fields": {"role": role, "worker": name}})
            for name in self._drain_order(running)[:max(0, len(running) - want)]:
                self.launcher.drain_worker(name)
                log.info("autoscaler: draining %s", name, extra={"fields": {"role": role, "worker": name}})

    def flip(self, flip: RoleFlip) -> list[str]:
        """Ask the least loaded serving workers of `flip.source` to serve `flip.target` (all at once; each call
        returns once its worker serves the new role); the names that did."""
        entries = self.observer.entries
        names = flip_candidates(entries.values(), flip.source, self.launcher.workers(flip.source))[:flip.workers]
        results = flip_workers({n: entries[n].endpoint for n in names}, flip.target)
        for name, problem in results.items():
            fields = {"worker": name, "source": flip.source, "target": flip.target}
            if problem is None:
                self.launcher.moved(name, flip.target)
                log.info("autoscaler: flipped %s to %s", name, flip.target, extra={"fields": fields})
            else:
                log.warning("autoscaler: %s did not flip to %s: %s", name, flip.target, problem,
                            extra={"fields": fields})
        return [n for n, problem in results.items() if problem is None]

    def _drain_order(self, names: list[str]) -> list[str]:
        """Which workers to drain first: those not serving yet (nothing in flight), then the least loaded, then
        the newest."""
        entries = self.observer.entries

        def key(item: tuple[int, str]) -> tuple[int, int, int]:
            index, name = item
            e = entries.get(name)
            if e is None:
                return (0, 0, -index)
            return (1, e.num_running + e.num_waiting, -index)

        return [name for _, name in sorted(enumerate(names), key=key)]

    def close(self) -> None:
        self.observer.close()
