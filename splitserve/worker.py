"""A worker process: wires the config to a role's service, behind a gRPC server (`common.protocol.server`, which
hands it the calls in dataclass messages) and an HTTP server for /metrics, /healthz, /readyz and /stats.

The engine loads (as its entry in `splitserve.common.engines` says) while both servers already answer
(readiness is false until the role's service is built). Each role assembles its own service (`splitserve.prefill_worker.build`, `splitserve.decode_worker.build`);
this module knows no role's internals. The HTTP server runs on its own thread and event loop and reads the
engine's last published counters, so a long step or a busy gRPC loop never delays a probe or a scrape.
On SIGTERM the worker drains: it reports itself draining (the gateways send it nothing new), finishes its
requests in flight for up to the role's `drainSeconds`, and exits. A role flip (the `flip` call) drains the same
way for its call's drain seconds, then builds the other role's service on the same engine, by the path the
start takes (`Worker.assemble`), and registers under that role. Hosting is apart from assembly: `serve` runs a
worker until its stop event is set, `run_process` makes this process the host (signals set the event).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from splitserve.common import engines
from splitserve.common.config import ClusterResource, ClusterSpec
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol.server import GrpcWorkerServer
from splitserve.common.role_flips import flip_problem
from splitserve.common.worker_context import WorkerContext
from splitserve.common.worker_messages import (
    Draining,
    FlipCall,
    FlipRefused,
    FlipReply,
    GenerateCall,
    GenerateChunk,
    HealthReport,
    LoadReport,
    NotReady,
    NotServed,
    PrefillCall,
    PrefillReply,
    RetryReason,
)
from splitserve.common.worker_metrics import (
    HEALTH_FLAPS,
    ROLE_FLIP_SECONDS,
    ROLE_FLIPS,
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
from splitserve.worker_presence import ClusterPresence

log = logging.getLogger("splitserve.worker")
HTTP_START_S = 30.0  # the metrics server is listening within this, or the worker does not start


class PortInUse(OSError):
    """A port the worker was given cannot be listened on (another process holds it)."""

RoleBuilder = Callable[[ClusterSpec, ServingEngine, WorkerContext], Awaitable[Any]]
STOP_GRACE_SECONDS = 2.0  # after the drain: for the last messages of moved streams, and calls still finishing

ROLES: dict[str, RoleBuilder] = {"prefill": build_prefill, "decode": build_decode, "both": build_colocated}


@dataclass
class _Stream:
    in_engine: bool = False  # waiting for the engine's next chunk (else the server is sending the last one)
    moved: bool = False  # ended by the drain's end (moved to another worker)


class Worker:
    """A worker's calls (the `WorkerHandler` its gRPC server serves) and where it stands: loading (no service
    yet), ready, draining, changing role (a flip), dead (its engine stopped). Calls go to the role's service;
    the calls in flight are counted, and the streams still running when the drain runs out are ended so that
    they move. `presence` and `ctx` are set by its host before `assemble`."""

    def __init__(self, spec: ClusterSpec, role: str) -> None:
        self.spec = spec
        self.role = role
        self.engine: ServingEngine | None = None
        self.service: Any = None  # the role's service once built (readiness)
        self.presence: ClusterPresence | None = None
        self.ctx: WorkerContext | None = None
        self.outstanding = 0
        self.draining = False
        self.switching = False  # a flip is under way: nothing new is taken
        self._was_healthy = False
        self._streams: dict[asyncio.Task, _Stream] = {}  # the generate calls in flight
        self._flip: asyncio.Future[FlipReply] | None = None  # the flip under way (or the last one)
        self._flip_target = ""

    @property
    def ready(self) -> bool:
        leaving = self.draining or self.switching
        ok = self.service is not None and not leaving and not self.dead
        if self._was_healthy and not ok and not leaving:
            HEALTH_FLAPS.inc()  # it was serving, and now cannot (its engine died)
        self._was_healthy = ok
        return ok

    @property
    def dead(self) -> bool:
        return self.engine is not None and self.engine.dead

    def _need_ready(self) -> None:
        if self.service is None:
            raise NotReady("worker is loading its model")

    def _serving(self, method: str):
        """The role service's `method`; raises while it cannot take a new call."""
        self._need_ready()
        if self.draining:  # before its gRPC server stops taking calls: the caller tries another worker
            raise Draining("worker is draining")
        if self.switching:
            raise Draining(f"worker is changing role to {self._flip_target}")
        handler = getattr(self.service, method, None)
        if handler is None:
            raise NotServed(f"a {self.role} worker does not serve {method}")
        return handler

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        handler = self._serving("generate")
        self.outstanding += 1
        task = asyncio.current_task()
        stream = _Stream()
        self._streams[task] = stream
        chunks = handler(call)
        try:
            while True:
                stream.in_engine = True
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                finally:
                    stream.in_engine = False
                yield chunk
                if stream.moved:  # moved while the server was sending that chunk: end it here
                    await chunks.aclose()  # the engine lets the request go
                    yield self._moved_chunk(call)
                    return
        except asyncio.CancelledError:
            if not stream.moved:
                raise
            yield self._moved_chunk(call)
        finally:
            self._streams.pop(task, None)
            self.outstanding -= 1

    def _moved_chunk(self, call: GenerateCall) -> GenerateChunk:
        """The drain ran out of time: the request ends here and the gateway moves it to another worker."""
        why = "changing role" if self.switching else "stopping"
        return GenerateChunk(call.request_id, [], finished=True, finish_reason="error",
                             error=f"the worker is {why}: its drain time ran out", retry=RetryReason.DRAIN)

    def move_streams(self) -> int:
        """The drain ran out of time: end every stream still running with a retryable error (the gateway
        continues each elsewhere). Returns how many. A stream waiting on the engine is cancelled there; one
        whose last chunk the server is still sending is not (a cancel would land in the server's write and
        end the call with no reason): it ends when the server asks for its next chunk."""
        for task, stream in self._streams.items():
            stream.moved = True
            if stream.in_engine:
                task.cancel()
        return len(self._streams)

    async def prefill(self, call: PrefillCall) -> PrefillReply:
        return await self._answer(self._serving("prefill"), call)

    async def prefill_early(self, call: PrefillCall, ticket: Awaitable[bytes]) -> PrefillReply:
        return await self._answer(self._serving("prefill_early"), call, ticket)

    async def _answer(self, handler, *args) -> PrefillReply:
        """A call with one answer, counted outstanding while the service works on it."""
        self.outstanding += 1
        try:
            return await handler(*args)
        finally:
            self.outstanding -= 1

    async def abort(self, request_id: str) -> bool:
        self._need_ready()
        await self.engine.abort(request_id)
        return True

    def health(self) -> HealthReport:
        control = getattr(self.engine, "control", None)  # engine vllm with the layerwise connector
        return HealthReport(live=not self.dead, ready=self.ready, role=self.role,
                            draining=self.draining or self.switching,
                            model=self.spec.model.served_name, protocol_version=PROTOCOL_VERSION,
                            engine=self.spec.engine_of(self.role),
                            capabilities=frozenset({"resume"}) if self.role != "prefill" else frozenset(),
                            kv_connector=self.kv_connector,
                            kv_transports=dict(control.transports) if control is not None else {})

    @property
    def kv_connector(self) -> str:
        """In disaggregated mode, the KV connector the engine names (engine vllm: vllm.connector); else empty."""
        if self.role == "both" or self.spec.mode != "disaggregated":
            return ""
        return engines.get(self.spec.engine_of(self.role)).connector(self.spec)

    def load(self) -> LoadReport:
        self._need_ready()
        return LoadReport(**self.stats())

    # -- the role's service, at the start and at a flip ------------------------------------------------
    async def assemble(self, role: str) -> None:
        """Build `role`'s service on the loaded engine: the one path a start and a flip share."""
        self.service = await ROLES[role](self.spec, self.engine, self.ctx)
        self.role = role

    async def flip(self, call: FlipCall) -> FlipReply:
        """Serve `call.role` instead, on the same engine. Raises `FlipRefused` when this worker cannot; the flip
        runs to its end even when the caller gives up, and a second call for the same role waits for it."""
        self._need_ready()
        if self.draining:
            raise Draining("worker is draining")
        if self._flip is not None and not self._flip.done():
            if call.role != self._flip_target:
                raise FlipRefused(f"a flip to {self._flip_target} is under way")
        else:
            problem = flip_problem(self.spec, self.role, call.role, self.presence.link is not None)
            if problem is not None:
                raise FlipRefused(problem)
            self._flip_target = call.role
            self._flip = asyncio.ensure_future(self._flip_to(call.role, call.drain_seconds))
        return await asyncio.shield(self._flip)

    async def _flip_to(self, target: str, drain_s: float) -> FlipReply:
        """Leave the role (registry: draining), let its requests finish (a decode worker's streams move after
        `drain_s`; prefills always finish, within the KV transfer's timeout), swap the service, register as
        `target`."""
        t0 = time.monotonic()
        source = self.role
        self.switching = True
        log.info("worker %s: flipping to %s (%d requests in flight)", source, target, self.outstanding)
        try:
            await self.presence.leave_role()
            moved = await _drain(self, drain_s if source == "decode"
                                 else max(drain_s, self.spec.kv_transfer.timeout_seconds))
            try:
                await self._swap(source, target)
            finally:
                await self.presence.serve_as(self.role)  # the new role (or, when it failed, the old one again)
        finally:
            self.switching = False
        seconds = time.monotonic() - t0
        ROLE_FLIPS.labels(source, target, "ok").inc()
        ROLE_FLIP_SECONDS.labels(target).observe(seconds)
        log.info("worker flipped %s -> %s in %.2f s (%d streams moved)", source, target, seconds, moved,
                 extra={"fields": {"source": source, "target": target, "seconds": round(seconds, 3),
                                   "moved_streams": moved}})
        return FlipReply(target, source, seconds, moved)

    async def settle_flip(self) -> None:
        """Until the flip under way (if any) has ended: its service is being swapped."""
        if self._flip is not None and not self._flip.done():
            await asyncio.gather(self._flip, return_exceptions=True)

    async def _swap(self, source: str, target: str) -> None:
        """The old role's service closed, the new one's built; if it cannot be, the old one again."""
        engine = self.spec.engine_of(source)
        await self.service.close()
        try:
            await self.assemble(target)
        except (OSError, RuntimeError, ValueError) as e:  # its KV transfer agent or pool did not start
            ROLE_FLIPS.labels(source, target, "failed").inc()
            log.error("worker %s: the %s service could not be built (%s); serving %s again", source, target, e,
                      source)
            await self.assemble(source)
            raise FlipRefused(f"the {target} service could not be built on this worker: {e}") from None
        WORKER_ENGINE.remove(engine, source)
        WORKER_ENGINE.labels(engine, target).set(1)

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


def http_app(worker: Worker) -> Starlette:
    async def metrics(_: Request) -> Response:
        if worker.engine is not None:
            worker.stats()  # refresh the gauges
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        dead = worker.dead
        return JSONResponse({"live": not dead}, status_code=503 if dead else 200)

    async def readyz(_: Request) -> Response:
        ready = worker.ready
        return JSONResponse({"ready": ready, "draining": worker.draining}, status_code=200 if ready else 503)

    async def stats(_: Request) -> Response:
        if worker.engine is None:
            return JSONResponse({"error": "loading"}, status_code=503)
        return JSONResponse(worker.stats())

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz), Route("/readyz", readyz),
                             Route("/stats", stats)])


async def _drain(worker: Worker, seconds: float) -> int:
    """Let the calls in flight finish for up to `seconds`; then tell the streams still running to move (returns
    how many). A worker whose engine died waits for nothing: its calls cannot finish here."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while worker.outstanding and not worker.dead and loop.time() < deadline:
        await asyncio.sleep(0.05)
    moved = worker.move_streams()
    if moved:
        why = "its engine died" if worker.dead else "drain time ran out"
        log.warning("worker %s: %s; %d streams move to other workers", worker.role, why, moved)
        end = loop.time() + STOP_GRACE_SECONDS
        while worker.outstanding and loop.time() < end:
            await asyncio.sleep(0.05)  # their last message goes out
    return moved


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
    worker = Worker(spec, role)
    server = GrpcWorkerServer(worker)
    http = HTTPThread(http_app(worker), host, role_spec.metrics_port)
    try:
        try:
            await server.start(f"{host}:{role_spec.port}")
        except OSError as e:
            raise PortInUse(f"--port: cannot listen on {host}:{role_spec.port} (in use?)") from e
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
    worker.presence = presence
    kind = engines.get(spec.engine_of(role))
    loader = asyncio.ensure_future(kind.resolve_load()(spec, role, adv, vllm_url, stop))
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loader, waiter}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    try:
        if loader.done():
            if loader.exception() is not None:
                log.error("model load failed: %s", loader.exception())
                code = 2
            else:
                worker.engine = loader.result()
                worker.ctx = WorkerContext(presence.name, presence.instance_id, host, presence.membership,
                                           presence.link, presence.keys)
                await worker.assemble(role)
                await presence.join(worker.engine)
                log.info("worker %s ready", role)
                await waiter
        await worker.settle_flip()
        worker.draining = True
        await presence.drain()
        drain_s = spec.role(worker.role).drain_seconds  # the role it serves now (a flip may have changed it)
        log.info("worker %s draining: %d requests in flight (up to %.0f s)", worker.role, worker.outstanding,
                 drain_s)
        await _drain(worker, drain_s)
        await server.stop(grace=STOP_GRACE_SECONDS)
        log.info("worker %s stopped", worker.role)
    finally:
        http.stop()
        if worker.service is not None:
            await worker.service.close()
        await presence.close()
        if worker.engine is not None:
            aclose = getattr(worker.engine, "aclose", None)
            if aclose is not None:  # engine vllm: its HTTP client, then its server (stopping takes a while)
                await aclose()
                await asyncio.to_thread(worker.engine.shutdown)
            else:
                worker.engine.shutdown()
        elif not loader.done() and kind.server_beside:  # its load sees the stop and stops its server
            await asyncio.gather(loader, return_exceptions=True)
        # stopped while loading: the load thread finishes on its own; the host decides whether to wait for it
        log.info("worker %s closed", worker.role)
    return code
