"""A worker process: wires the config to a role's service, behind a gRPC server (grpc.aio) and an HTTP server for
/metrics, /healthz, /readyz and /stats.

The engine loads in a thread while both servers already answer (readiness is false until the role's service is
built). Each role assembles its own service (`splitserve.prefill_worker.build`, `splitserve.decode_worker.build`);
this module knows no role's internals. The HTTP server runs on its own thread and event loop and reads the
engine's last published counters, so a long step or a busy gRPC loop never delays a probe or a scrape.
On SIGTERM the worker drains: it reports itself draining (the gateways send it nothing new), finishes its
requests in flight for up to the role's `drainSeconds`, and exits. Hosting is apart from assembly: `serve` runs
a worker until its stop event is set, `run_process` makes this process the host (signals set the event).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from splitserve.common.config import ClusterResource, ClusterSpec
from splitserve.common.kv_events import KVEventPublisher
from splitserve.common.membership import Membership, StaticMembership
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.service import add_worker_service
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import Keys, RegistryEntry
from splitserve.common.registry import RedisMembership, Registration
from splitserve.common.worker_context import WorkerContext
from splitserve.common.worker_metrics import (
    HEALTH_FLAPS,
    WORKER_ENGINE,
    WORKER_KV_TOTAL,
    WORKER_KV_USAGE,
    WORKER_RUNNING,
    WORKER_WAITING,
)
from splitserve.decode_worker.build import build as build_decode
from splitserve.decode_worker.build import build_colocated
from splitserve.engine.interface import ServingEngine
from splitserve.prefill_worker.build import build as build_prefill

log = logging.getLogger("splitserve.worker")
# no SO_REUSEPORT: a second process on a worker's port must fail to start, not share its traffic
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", 0)]
HTTP_START_S = 30.0  # the metrics server is listening within this, or the worker does not start


class PortInUse(OSError):
    """A port the worker was given cannot be listened on (another process holds it)."""

RoleBuilder = Callable[[ClusterSpec, ServingEngine, WorkerContext], Awaitable[Any]]
STOP_GRACE_SECONDS = 2.0  # after the drain: for the last messages of moved streams, and calls still finishing

ROLES: dict[str, RoleBuilder] = {"prefill": build_prefill, "decode": build_decode, "both": build_colocated}


def load_engine(spec: ClusterSpec, role: str) -> ServingEngine:
    """Load the model with the role's engine settings (runs in a thread)."""
    from splitserve.engine.host_memory import bound_host_memory

    bound_host_memory()
    import torch

    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.engine.config import engine_config
    from splitserve.engine.llm_engine import LLMEngine

    settings = spec.role(role).engine
    if settings.threads:
        torch.set_num_threads(settings.threads)
    config = engine_config(spec.model, settings)
    if role in ("prefill", "decode"):  # every tensor-parallel rank streams its own KV shard
        from splitserve.kv_transfer.rank_connector import SPEC

        config.parallel.rank_connector = SPEC
    return AsyncEngine(LLMEngine(config))


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, spec: ClusterSpec, role: str) -> None:
        self.spec = spec
        self.role = role
        self.engine: ServingEngine | None = None
        self.service: Any = None  # the role's service once built (readiness)
        self.outstanding = 0
        self.draining = False
        self._was_healthy = False
        self._streams: set[asyncio.Task] = set()  # the Generate calls in flight
        self._moved: set[asyncio.Task] = set()  # those ended by the drain's end (moved to another worker)

    @property
    def ready(self) -> bool:
        ok = self.service is not None and not self.draining and not self.dead
        if self._was_healthy and not ok and not self.draining:
            HEALTH_FLAPS.inc()  # it was serving, and now cannot (its engine died)
        self._was_healthy = ok
        return ok

    async def _need_ready(self, context) -> None:
        if self.service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is loading its model")

    async def _serve(self, method: str, request, context):
        await self._need_ready(context)
        if self.draining:  # before its gRPC server stops taking calls: the caller tries another worker
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        handler = getattr(self.service, method, None)
        if handler is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"a {self.role} worker does not serve {method}")
        return handler

    async def Generate(self, request, context):
        handler = await self._serve("generate", request, context)
        self.outstanding += 1
        task = asyncio.current_task()
        self._streams.add(task)
        try:
            async for out in handler(request, context):
                if out.finished and out.finish_reason in ("error", "abort") and self.dead:
                    out.retry = "engine"  # this worker can no longer run it; another one can
                yield out
        except asyncio.CancelledError:
            if task not in self._moved:
                raise
            # the drain ran out of time: the request ends here and the gateway moves it to another worker
            yield pb.GenerateResponse(request_id=request.request_id, finished=True, finish_reason="error",
                                      error="the worker is stopping: its drain time ran out", retry="drain")
        finally:
            self._streams.discard(task)
            self.outstanding -= 1

    def move_streams(self) -> int:
        """The drain ran out of time: end every stream still running with a retryable error (the gateway
        continues each elsewhere). Returns how many."""
        for task in self._streams:
            self._moved.add(task)
            task.cancel()
        return len(self._streams)

    async def Prefill(self, request, context):
        return await self._answer("prefill", request, context)

    async def PrefillEarly(self, request_iterator, context):
        return await self._answer("prefill_early", request_iterator, context)

    async def _answer(self, method: str, request, context):
        """A call with one answer, counted outstanding while the service works on it."""
        handler = await self._serve(method, request, context)
        self.outstanding += 1
        try:
            return await handler(request, context)
        finally:
            self.outstanding -= 1

    async def Abort(self, request, context):
        await self._need_ready(context)
        await self.engine.abort(request.request_id)
        return pb.AbortResponse(found=True)

    async def Health(self, request, context):
        control = getattr(self.engine, "control", None)  # engine vllm with the layerwise connector
        return pb.HealthResponse(live=not self.dead, ready=self.ready, role=self.role, draining=self.draining,
                                 model=self.spec.model.served_name, protocol_version=PROTOCOL_VERSION,
                                 engine=self.spec.engine_of(self.role),
                                 capabilities=["resume"] if self.role != "prefill" else [],
                                 kv_connector=self.kv_connector,
                                 kv_transports=control.transports if control is not None else {})

    @property
    def kv_connector(self) -> str:
        """engine vllm in disaggregated mode: its KV connector (vllm.connector); empty otherwise."""
        if self.spec.engine_of(self.role) != "vllm" or self.role == "both" or self.spec.mode != "disaggregated":
            return ""
        return self.spec.vllm.connector

    @property
    def dead(self) -> bool:
        return self.engine is not None and self.engine.dead

    async def Stats(self, request, context):
        await self._need_ready(context)
        return pb.StatsResponse(**self.stats())

    def stats(self) -> dict:
        """The engine's last published counters (safe from any thread; never waits for a step)."""
        s = self.engine.stats()
        WORKER_RUNNING.set(s["num_running"])
        WORKER_WAITING.set(s["num_waiting"])
        WORKER_KV_USAGE.set(s["kv_blocks_used"])
        WORKER_KV_TOTAL.set(s["kv_blocks_total"])
        return {k: s.get(k, 0) for k in ("num_waiting", "num_running", "kv_blocks_used", "kv_blocks_total",
                                         "tokens_in_flight", "num_waiting_remote_kv", "num_held")} | {
            "outstanding_requests": self.outstanding}


def http_app(servicer: WorkerServicer) -> Starlette:
    async def metrics(_: Request) -> Response:
        if servicer.engine is not None:
            servicer.stats()  # refresh the gauges
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        dead = servicer.dead
        return JSONResponse({"live": not dead}, status_code=503 if dead else 200)

    async def readyz(_: Request) -> Response:
        ready = servicer.ready
        return JSONResponse({"ready": ready, "draining": servicer.draining}, status_code=200 if ready else 503)

    async def stats(_: Request) -> Response:
        if servicer.engine is None:
            return JSONResponse({"error": "loading"}, status_code=503)
        return JSONResponse(servicer.stats())

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz), Route("/readyz", readyz),
                             Route("/stats", stats)])


class ClusterPresence:
    """A worker's part in the Redis-backed cluster: its registry entry (a lease, with its load), its KV block
    events, and the registry as the membership its role uses. Redis-free: a static membership and nothing else."""

    def __init__(self, spec: ClusterSpec, role: str, name: str, endpoint: str, metrics_url: str) -> None:
        self.spec, self.role, self.name = spec, role, name
        self.endpoint, self.metrics_url = endpoint, metrics_url
        self.instance_id = uuid.uuid4().hex[:16]
        url = spec.redis.resolved_url()
        self.link = RedisLink(url) if url else None
        self.keys = Keys(spec.model.served_name)
        self.registration: Registration | None = None
        self.publisher: KVEventPublisher | None = None
        if self.link is not None:
            self.membership: Membership = RedisMembership(self.link, self.keys)
        else:
            self.membership = StaticMembership(spec.membership.prefill, spec.membership.decode,
                                               "both" if spec.mode == "colocated" else "decode")

    async def start(self) -> None:
        if self.link is not None:
            await self.link.start()
        await self.membership.start()

    async def join(self, engine: ServingEngine) -> None:
        """Publish this worker: its KV events from now on, then its registry entry (it takes requests)."""
        if self.link is None:
            return
        self.publisher = KVEventPublisher(self.link.client, self.keys, self.name, self.instance_id)
        engine.add_kv_event_listener(self.publisher.listener)
        self.publisher.start()

        def load() -> dict:
            s = engine.stats()
            return {"num_waiting": s["num_waiting"], "num_running": s["num_running"],
                    "kv_blocks_used": s["kv_blocks_used"], "waiting_prefill_tokens": s["waiting_prefill_tokens"]}

        entry = RegistryEntry(self.name, self.instance_id, self.role, self.spec.model.served_name, self.endpoint,
                              self.metrics_url, engine.facts.block_size, engine.facts.num_kv_blocks)
        self.registration = Registration(self.link, self.keys, entry, self.spec.redis.lease_seconds, load=load)
        self.registration.on_lost = self._republish
        await self.registration.start()
        self.link.on_up(self._rejoin)
        log.info("registered as %s (instance %s) at %s", self.name, self.instance_id, self.endpoint)

    async def _rejoin(self) -> None:
        """Redis is back (perhaps empty, perhaps another one): register again and republish the whole cache."""
        self.publisher.resync()
        await self.registration.refresh()

    async def _republish(self) -> None:
        self.publisher.resync()

    async def drain(self) -> None:
        if self.registration is not None:
            await self.registration.drain()

    async def close(self) -> None:
        if self.registration is not None:
            await self.registration.close()
        if self.publisher is not None:
            await self.publisher.flush()
            await self.publisher.close()
        await self.membership.close()
        if self.link is not None:
            await self.link.close()


async def _drain(servicer: WorkerServicer, seconds: float) -> None:
    """Let the calls in flight finish for up to `seconds`; then tell the streams still running to move. A worker
    whose engine died waits for nothing: its calls cannot finish here."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while servicer.outstanding and not servicer.dead and loop.time() < deadline:
        await asyncio.sleep(0.05)
    moved = servicer.move_streams()
    if moved:
        why = "its engine died" if servicer.dead else "drain time ran out"
        log.warning("worker %s: %s; %d streams move to other workers", servicer.role, why, moved)
        end = loop.time() + STOP_GRACE_SECONDS
        while servicer.outstanding and loop.time() < end:
            await asyncio.sleep(0.05)  # their last message goes out


def advertised(host: str, advertise_host: str | None) -> str:
    """The address peers reach this worker at: --advertise-host, else the bind address (else this host's)."""
    if advertise_host:
        return advertise_host
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class HTTPThread:
    """The worker's HTTP server on a thread and event loop of its own."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False))
        self.server.install_signal_handlers = lambda: None  # the main thread handles signals
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)

    def start(self) -> None:
        """Start serving; PortInUse if the server cannot listen (uvicorn logs why and ends its thread)."""
        self.thread.start()
        deadline = time.monotonic() + HTTP_START_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                config = self.server.config
                raise PortInUse(f"--metrics-port: cannot listen on {config.host}:{config.port} (in use?)")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


async def run_process(resource: ClusterResource, role: str, host: str, name: str | None = None,
                      advertise_host: str | None = None, vllm_url: str | None = None) -> int:
    """Host a worker as this process (`splitserve worker`): SIGTERM or SIGINT set its stop event (drain, then
    return). The exit code: 0, or 2 when the model did not load."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await serve(resource, role, host, stop, name, advertise_host, vllm_url)


async def serve(resource: ClusterResource, role: str, host: str, stop: asyncio.Event, name: str | None = None,
                advertise_host: str | None = None, vllm_url: str | None = None) -> int:
    """Assemble a worker and serve until `stop` is set, then drain (up to the role's drainSeconds) and close.
    Installs no signal handler and never exits the process, so any host (this process, a Ray Serve replica)
    decides what stops it. Returns 0, or 2 when the model did not load.

    With engine vllm the worker starts a vLLM server as its child (stopped after the drain), or, given
    `vllm_url`, uses the one already serving there (the container beside it in a pod)."""
    spec = resource.spec
    role_spec = spec.role(role)
    servicer = WorkerServicer(spec, role)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    add_worker_service(servicer, server)  # a request that does not decode: INVALID_ARGUMENT
    http = HTTPThread(http_app(servicer), host, role_spec.metrics_port)
    try:
        try:
            server.add_insecure_port(f"{host}:{role_spec.port}")
        except RuntimeError as e:  # grpc: "Failed to bind to address ..."
            raise PortInUse(f"--port: cannot listen on {host}:{role_spec.port} (in use?)") from e
        await server.start()
        http.start()
    except PortInUse:
        await server.stop(None)
        raise
    HEALTH_FLAPS.inc(0)
    WORKER_ENGINE.labels(spec.engine_of(role), role).set(1)
    log.info("worker %s listening: grpc %s:%d metrics %d", role, host, role_spec.port, role_spec.metrics_port)
    adv = advertised(host, advertise_host)
    presence = ClusterPresence(spec, role, name or f"{socket.gethostname()}-{role_spec.port}",
                               f"{adv}:{role_spec.port}", f"http://{adv}:{role_spec.metrics_port}")
    await presence.start()
    if spec.engine_of(role) == "vllm":
        from splitserve.vllm_engine.launch import launch

        loader = asyncio.ensure_future(launch(spec, role, adv, vllm_url, stop))
    else:
        loader = asyncio.ensure_future(asyncio.to_thread(load_engine, spec, role))
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loader, waiter}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    try:
        if loader.done():
            if loader.exception() is not None:
                log.error("model load failed: %s", loader.exception())
                code = 2
            else:
                servicer.engine = loader.result()
                ctx = WorkerContext(presence.name, presence.instance_id, host, presence.membership, presence.link,
                                    presence.keys)
                servicer.service = await ROLES[role](spec, servicer.engine, ctx)
                await presence.join(servicer.engine)
                log.info("worker %s ready", role)
                await waiter
        servicer.draining = True
        await presence.drain()
        log.info("worker %s draining: %d requests in flight (up to %.0f s)", role, servicer.outstanding,
                 role_spec.drain_seconds)
        await _drain(servicer, role_spec.drain_seconds)
        await server.stop(grace=STOP_GRACE_SECONDS)
        log.info("worker %s stopped", role)
    finally:
        http.stop()
        if servicer.service is not None:
            await servicer.service.close()
        await presence.close()
        if servicer.engine is not None:
            aclose = getattr(servicer.engine, "aclose", None)
            if aclose is not None:  # engine vllm: its HTTP client, then its server (stopping takes a while)
                await aclose()
                await asyncio.to_thread(servicer.engine.shutdown)
            else:
                servicer.engine.shutdown()
        elif not loader.done() and spec.engine_of(role) == "vllm":  # it sees the stop and stops its server
            await asyncio.gather(loader, return_exceptions=True)
        # stopped while loading: the load thread finishes on its own; the host decides whether to wait for it
        log.info("worker %s closed", role)
    return code
