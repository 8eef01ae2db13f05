"""A worker process: the engine behind a gRPC server (grpc.aio), plus /metrics and health over HTTP.

Roles: `prefill` (Prefill RPC, streams KV out), `decode` (Generate RPC, KV streamed in, local fallback),
`both` (colocated: Generate with local prefill only). Readiness is false until the model is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

import grpc
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from splitserve.metrics import WORKER_KV_TOTAL, WORKER_KV_USAGE, WORKER_RUNNING, WORKER_WAITING
from splitserve.protocol import PROTOCOL_VERSION
from splitserve.protocol import splitserve_pb2 as pb
from splitserve.protocol import splitserve_pb2_grpc as pb_grpc

log = logging.getLogger("splitserve.worker")
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


@dataclass
class WorkerConfig:
    role: str = "both"  # prefill | decode | both
    model: str = "smollm2"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0  # 0: no HTTP endpoint
    kv_transport: str = "auto"
    kv_cache_memory: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    prefill_peers: list[str] = field(default_factory=list)
    disagg_threshold: int = 512
    transfer_timeout: float = 30.0
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    tensor_parallel_size: int = 1  # GPUs (one process each) sharing the model
    expert_parallel: bool = False  # MoE: spread experts over those GPUs

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.kv_transport not in ("auto", "nixl", "tcp"):
            raise ValueError(f"kv_transport must be auto, nixl or tcp, got {self.kv_transport!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1-65535, got {self.port}")
        if self.disagg_threshold < 1:
            raise ValueError("disagg_threshold must be >= 1")
        if self.transfer_timeout <= 0:
            raise ValueError("transfer_timeout must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.role != "both":
            raise ValueError("tensor_parallel_size > 1 runs with --role both only: streaming KV between "
                             "tensor-parallel prefill and decode workers is not supported yet")


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.ready = False
        self.engine = None  # AsyncEngine once loaded
        self.decode = None
        self.prefill_service = None
        self.outstanding = 0

    async def _need_ready(self, context) -> None:
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is loading its model")

    async def Generate(self, request, context):
        await self._need_ready(context)
        if self.decode is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"a {self.cfg.role} worker does not serve Generate")
        self.outstanding += 1
        try:
            async for out in self.decode.generate(request, context):
                yield out
        finally:
            self.outstanding -= 1

    async def Prefill(self, request, context):
        await self._need_ready(context)
        if self.prefill_service is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"a {self.cfg.role} worker does not serve Prefill")
        self.outstanding += 1
        try:
            return await self.prefill_service.prefill(request, context)
        finally:
            self.outstanding -= 1

    async def Abort(self, request, context):
        await self._need_ready(context)
        await self.engine.abort(request.request_id)
        return pb.AbortResponse(found=True)

    async def Health(self, request, context):
        return pb.HealthResponse(live=True, ready=self.ready, role=self.cfg.role,
                                 model=self.cfg.served_model_name or self.cfg.model, protocol_version=PROTOCOL_VERSION)

    async def Stats(self, request, context):
        await self._need_ready(context)
        s = await self.stats()
        return pb.StatsResponse(**s)

    async def stats(self) -> dict:
        s = await self.engine.stats()
        WORKER_RUNNING.set(s["num_running"])
        WORKER_WAITING.set(s["num_waiting"])
        WORKER_KV_USAGE.set(s["kv_blocks_used"])
        WORKER_KV_TOTAL.set(s["kv_blocks_total"])
        return {k: s[k] for k in ("num_waiting", "num_running", "kv_blocks_used", "kv_blocks_total",
                                  "tokens_in_flight", "num_waiting_remote_kv", "num_held")} | {
            "outstanding_requests": self.outstanding}

    def load(self) -> None:
        """Load the model and the KV transfer agent (runs in a thread)."""
        import torch

        from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
        from splitserve.engine.config import ParallelConfig
        from splitserve.engine.llm_engine import LLMEngine

        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(cfg.model, dtype=cfg.dtype, device=cfg.device, max_model_len=cfg.max_model_len,
                              served_model_name=cfg.served_model_name),
            cache=CacheConfig(block_size=cfg.block_size, kv_cache_memory=cfg.kv_cache_memory),
            scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens),
            parallel=ParallelConfig(cfg.tensor_parallel_size, cfg.expert_parallel),
        ))
        agent = None
        if cfg.role in ("prefill", "decode"):
            from splitserve.kv_transfer import KVLayout, make_agent

            agent = make_agent(cfg.kv_transport, KVLayout(engine.runner.kv_caches), host=cfg.host)
            log.info("kv transfer agent %s on %s", agent.name, agent.backend.name)
        self.agent = agent
        self._llm = engine

    def wire(self) -> None:
        """Build the role's services on the event loop (gRPC channels need it); readiness flips here."""
        cfg, engine, agent = self.cfg, self._llm, self.agent
        from splitserve.engine.async_engine import AsyncEngine
        from splitserve.kv_transfer import metrics as kv_metrics
        from splitserve.metrics import LOCAL_PREFILL

        # every label set this worker can report starts at 0, so dashboards see the series from the start
        for direction in ("send", "recv"):
            kv_metrics.BYTES.labels(direction, agent.backend.name if agent else "none")
        if cfg.role != "prefill":
            for reason in ("short_prompt", "fallback", "no_prefill_worker", "no_free_blocks"):
                LOCAL_PREFILL.labels(reason)

        if cfg.role == "prefill":
            from splitserve.kv_transfer.stream_hook import KVStreamHook
            from splitserve.prefill_worker.service import PrefillService

            hook = KVStreamHook(engine.kv_spec.block_size, cuda=engine.device.type == "cuda")
            engine.kv_hook = hook
            self.engine = AsyncEngine(engine)
            self.prefill_service = PrefillService(self.engine, agent, hook)
        else:
            from splitserve.decode_worker.service import DecodeService

            self.engine = AsyncEngine(engine)
            self.decode = DecodeService(self.engine, agent, cfg.prefill_peers, cfg.disagg_threshold,
                                        cfg.transfer_timeout)
        self.ready = True


def http_app(servicer: WorkerServicer) -> Starlette:
    async def metrics(_: Request) -> Response:
        if servicer.ready:
            await servicer.stats()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        dead = servicer.engine is not None and servicer.engine.dead
        return JSONResponse({"live": not dead}, status_code=503 if dead else 200)

    async def readyz(_: Request) -> Response:
        return JSONResponse({"ready": servicer.ready}, status_code=200 if servicer.ready else 503)

    async def stats(_: Request) -> Response:
        if not servicer.ready:
            return JSONResponse({"error": "loading"}, status_code=503)
        return JSONResponse(await servicer.stats())

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz), Route("/readyz", readyz),
                             Route("/stats", stats)])


async def serve(cfg: WorkerConfig) -> None:
    servicer = WorkerServicer(cfg)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    http = http_task = None
    if cfg.metrics_port:
        http = uvicorn.Server(uvicorn.Config(http_app(servicer), host=cfg.host, port=cfg.metrics_port,
                                             log_level="warning", access_log=False))
        http.install_signal_handlers = lambda: None  # this process handles its own signals
        http_task = asyncio.ensure_future(http.serve())
    log.info("worker %s listening: grpc %s:%d metrics %s", cfg.role, cfg.host, cfg.port, cfg.metrics_port or "-")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loader = asyncio.ensure_future(asyncio.to_thread(servicer.load))
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loader, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if loader.done() and loader.exception() is not None:
        log.error("model load failed: %s", loader.exception())
        await server.stop(0)
        if http is not None:
            http.should_exit = True
            await asyncio.wait({http_task}, timeout=5)
        raise SystemExit(2)
    if loader.done():
        servicer.wire()
        log.info("worker %s ready", cfg.role)
        await waiter
    log.info("worker %s shutting down", cfg.role)
    await server.stop(grace=2)
    if http is not None:
        http.should_exit = True
        await asyncio.wait({http_task}, timeout=5)
    if servicer.engine is not None:
        servicer.engine.shutdown()
    if getattr(servicer, "agent", None) is not None:
        servicer.agent.close()
