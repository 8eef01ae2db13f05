"""`splitserve up`: a SplitServeCluster as local processes on this machine (the gateway, prefill and decode
workers), from the same document the operator runs on Kubernetes.

The launcher picks free ports, writes the effective document (with the static membership it implies) to a
file that every child reads with `--config`, waits until every component is ready, prints the URL (a line
containing `ready`) and a curl example, and on Ctrl-C or SIGTERM stops everything. Children (workers, gateways,
Redis) die with the launcher even if it is killed (PR_SET_PDEATHSIG, which each child sets itself:
`dying_with_me`), and the launcher dies with whatever started it unless that was nohup or setsid.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from splitserve.common import engines
from splitserve.common.config import ClusterResource
from splitserve.common.config_file import dump
from splitserve.common.proc import dying_with_me, free_port, splitserve_command, usable_cores
from splitserve.hosts.common import (
    READY_TIMEOUT_S,
    gateway_all_healthy,
    ready_line,
    redis_command,
    wait_for_redis,
    worker_argv,
    worker_pools,
)

log = logging.getLogger("splitserve.launcher")


class Launcher:
    def __init__(self, resource: ClusterResource, host: str) -> None:
        self.resource = resource.model_copy(deep=True)
        self.host = host
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._reported: set[str] = set()
        self.retired: set[str] = set()  # workers drained on purpose (scale-down): their exit is no failure
        self.pool_of: dict[str, str] = {}  # worker name -> the pool it serves now (a role flip moves it)
        self.hurry = False  # set by a second Ctrl-C: `stop` kills what is still running instead of waiting
        self._next_index: dict[str, int] = {"prefill": 0, "decode": 0}
        spec = self.resource.spec
        self.components: dict = {"router": f"http://{host}:{spec.router.port}", "prefill": [], "decode": []}
        self._ports: set[int] = {spec.router.port}  # given to this cluster's processes (and the router's)
        self._dir = tempfile.TemporaryDirectory(prefix="splitserve-")
        self.config_path = Path(self._dir.name) / "cluster.yaml"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(dying_with_me(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                env={**os.environ, **env} if env else None)
        self.procs.append((name, proc))
        return proc

    def free_port(self) -> int:
        """A free port that no process of this cluster was given yet. A port picked free stays free only until
        its process binds it, seconds later, and two picks before then can return the same port (two of our
        processes on one port: one cannot listen), so every port handed out is remembered."""
        while (port := free_port(self.host)) in self._ports:
            pass
        self._ports.add(port)
        return port

    def plan(self) -> list[tuple[str, str, int, int]]:
        """(name, role, gRPC port, metrics port) of every worker, and the static membership in the document."""
        spec = self.resource.spec
        workers = [(f"{pool}-{i}", role) for pool, role in worker_pools(spec)
                   for i in range(spec.role(pool).replicas)]
        planned = [(name, role, self.free_port(), self.free_port()) for name, role in workers]
        spec.membership.prefill = [f"{self.host}:{p}" for _, role, p, _ in planned if role == "prefill"]
        spec.membership.decode = [f"{self.host}:{p}" for _, role, p, _ in planned if role != "prefill"]
        threads = max(1, usable_cores() // len(planned))
        for name, role in (("prefill", spec.prefill), ("decode", spec.decode)):
            if not role.engine.threads and engines.get(spec.engine_of(name)).takes_threads:  # else its own
                role.engine.threads = threads
        return planned

    def needs_redis(self) -> bool:
        spec = self.resource.spec
        return spec.redis.mode == "bundled" or (spec.redis.mode == "none" and (
            spec.router.policy == "kv_aware" or spec.kv_pool.enabled or self.autoscaling))

    @property
    def autoscaling(self) -> bool:
        """The SLO control law starts and drains workers (they find each other through the Redis registry)."""
        return self.resource.spec.autoscaling.mode == "slo"

    def start_redis(self) -> None:
        """A Redis for this cluster (bundled), on a free port, gone with the launcher."""
        port = self.free_port()
        proc = subprocess.Popen(dying_with_me(redis_command(self.host, port, self.resource.spec.kv_pool.max_memory)),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.procs.append(("redis", proc))
        wait_for_redis(self.host, port, proc)
        redis = self.resource.spec.redis
        redis.mode, redis.url = "bundled", f"redis://{self.host}:{port}/0"
        self.components["redis"] = {"url": redis.url, "pid": proc.pid}

    def start(self) -> None:
        if self.needs_redis():
            self.start_redis()
        planned = self.plan()
        self.config_path.write_text(dump(self.resource))
        self.components["config"] = str(self.config_path)
        for name, role, port, mport in planned:
            self._start_worker(name, role, port, mport)
        config = ["--config", str(self.config_path), "--host", self.host]
        spec = self.resource.spec
        self.components["routers"] = []
        for i in range(spec.router.replicas):
            port = spec.router.port if i == 0 else self.free_port()
            proc = self._spawn(f"router-{i}", [*splitserve_command(), "router", "--port", str(port), *config])
            self.components["routers"].append({"url": f"http://{self.host}:{port}", "pid": proc.pid})
        self.components["router_pid"] = self.components["routers"][0]["pid"]

    def _start_worker(self, name: str, role: str, port: int, mport: int) -> dict:
        argv = worker_argv(role, str(self.config_path), self.host, name, port=port, metrics_port=mport)
        proc = self._spawn(name, argv, self._engine_env(role))
        key = "prefill" if role == "prefill" else "decode"
        self._next_index[key] += 1
        self.pool_of[name] = key
        info = {"name": name, "grpc": f"{self.host}:{port}", "metrics": f"http://{self.host}:{mport}", "pid": proc.pid}
        self.components[key].append(info)
        return info

    def _engine_env(self, role: str) -> dict[str, str] | None:
        """What the role's engine needs in a worker's environment (engine vllm on CPU: its server's OpenMP threads
        on cores of its own), for the slot after the workers started so far, of as many as the plan has."""
        spec = self.resource.spec
        process_env = engines.get(spec.engine_of(role)).resolve_process_env()
        if process_env is None:
            return None
        slot, slots = sum(self._next_index.values()), len(spec.membership.prefill) + len(spec.membership.decode)
        return process_env(spec, role, slot, max(1, slots))  # a plan may start no worker (autoscaled from 0)

    def add_worker(self, pool: str) -> str:
        """Start one more worker of `pool` (prefill, or decode: colocated workers in colocated mode); its name."""
        name = f"{pool}-{self._next_index[pool]}"
        self._start_worker(name, self.resource.spec.worker_role(pool), self.free_port(), self.free_port())
        return name

    def workers(self, pool: str) -> list[str]:
        """Names of the worker processes serving `pool` now that are running and not being drained."""
        return [name for name, p in self.procs if self.pool_of.get(name) == pool and name not in self.retired
                and p.poll() is None]

    def moved(self, name: str, pool: str) -> None:
        """Worker `name` flipped: it serves `pool` now (its name stays)."""
        self.pool_of[name] = pool

    def drain_worker(self, name: str) -> None:
        """SIGTERM one worker: it marks itself draining in the registry, finishes its requests in flight (up to
        drainSeconds) and exits. Never SIGKILL here: `stop` does that only past the drain period."""
        proc = next(p for n, p in self.procs if n == name)
        self.retired.add(name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def dead(self, fatal_only: bool = False) -> str | None:
        """A component that exited; with fatal_only, only the last router or the last decode worker counts (the
        service goes on without a prefill worker, a decode worker or a router replica while others live; a
        dead Redis is degraded mode, not a failure)."""
        decode = [p for name, p in self.procs if self.pool_of.get(name) == "decode"]
        routers = [p for name, p in self.procs if name.startswith("router")]
        for name, p in self.procs:
            if p.poll() is None or name in self.retired:
                continue
            if not fatal_only or all(d.poll() is not None for d in decode) or \
                    all(r.poll() is not None for r in routers):
                return f"{name} exited with code {p.returncode}"
            if name not in self._reported:
                self._reported.add(name)
                log.warning("%s exited with code %s; still serving", name, p.returncode)
        return None

    def wait_ready(self, stop: list[bool]) -> bool:
        url = f"{self.components['router']}/health"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not stop[0]:
            problem = self.dead()
            if problem:
                log.error("startup failed: %s", problem)
                return False
            if gateway_all_healthy(url, len(self.components["prefill"]) + len(self.components["decode"])):
                return True
            time.sleep(0.1)
        if not stop[0]:
            log.error("startup timed out after %.0f s", READY_TIMEOUT_S)
        return False

    def stop(self) -> None:
        """SIGTERM the workers and gateways, and once they are gone Redis (their close talks to it); whatever has
        not exited once the drain period is over gets SIGKILL. Every 15 s it logs who is still running."""
        users = [(n, p) for n, p in self.procs if n != "redis"]
        self._stop_group(users, self.grace_seconds)
        self._stop_group([(n, p) for n, p in self.procs if n == "redis"], 10.0)
        self._dir.cleanup()

    @property
    def grace_seconds(self) -> float:
        """How long `stop` waits for workers and gateways after SIGTERM: the longest drain, and 10 s more."""
        spec = self.resource.spec
        return max(spec.prefill.drain_seconds, spec.decode.drain_seconds) + 10.0

    def _stop_group(self, procs: list[tuple[str, subprocess.Popen]], grace: float) -> None:
        for _, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        start = time.monotonic()
        next_report = start + 15.0
        while time.monotonic() - start < grace and not self.hurry:
            running = [n for n, p in procs if p.poll() is None]
            if not running:
                return
            if time.monotonic() >= next_report:
                next_report += 15.0
                log.info("stopping: still waiting for %s", ", ".join(running))
            time.sleep(0.05)
        for name, p in procs:
            if p.poll() is None:
                log.warning("%s did not exit %s: killing it", name,
                            "before a second Ctrl-C" if self.hurry else f"{grace:.0f} s after SIGTERM")
                p.kill()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %d) did not die after SIGKILL", name, p.pid)


def port_in_use(host: str, port: int) -> bool:
    """Whether `port` on `host` is taken by a listener (probed as a server binds it: SO_REUSEADDR, so a port
    left in TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_fixed_ports(resource: ClusterResource, host: str) -> None:
    """Before anything starts: the ports `up` binds that were not picked free (the gateway's), one line
    (ValueError) naming the flag when one is taken."""
    port = resource.spec.router.port
    if port_in_use(host, port):
        raise ValueError(f"--port (router.port): {host}:{port} is already in use; stop what listens there "
                         f"or pick another --port")


def run(resource: ClusterResource, host: str, profile: str | None = None) -> int:
    """Run the cluster until SIGINT/SIGTERM; with autoscaling.mode slo, the control law with replica `profile`
    (default: the committed one for the device)."""
    launcher = Launcher(resource, host)
    autoscaler = None
    stop = [False]

    def on_signal(signum, frame) -> None:
        if stop[0]:  # a second Ctrl-C (or SIGTERM): no more waiting for the drain
            launcher.hurry = True
            return
        stop[0] = True
        if signum == signal.SIGINT:
            log.info("stopping: streams in flight get up to %.0f s to finish (drainSeconds); Ctrl-C again stops "
                     "now", launcher.grace_seconds)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if launcher.autoscaling:  # what this machine holds, measured before any worker takes memory
            from splitserve.hosts.local.autoscale import LocalAutoscaler

            LocalAutoscaler.bound(launcher)
        launcher.start()
        if launcher.autoscaling:
            autoscaler = LocalAutoscaler.for_launcher(launcher, profile)
    except (RuntimeError, ValueError) as e:
        log.error("cannot start: %s", e)
        launcher.stop()
        return 2
    code = 0
    spec = launcher.resource.spec
    try:
        if not launcher.wait_ready(stop):
            return 0 if stop[0] else 1
        base = launcher.components["router"]
        name = spec.model.served_name
        print(ready_line(spec, base, spec.mode), flush=True)
        print(f"splitserve components {json.dumps(launcher.components)}", flush=True)
        print(f"try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              flush=True)
        while not stop[0]:
            problem = launcher.dead(fatal_only=True)
            if problem:
                log.error("stopping: %s", problem)
                code = 1
                break
            if autoscaler is not None:
                autoscaler.tick()
            time.sleep(0.3)
    finally:
        if autoscaler is not None:
            autoscaler.close()
        launcher.stop()
        log.info("all components stopped")
    return code
