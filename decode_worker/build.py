"""A decode worker assembles itself from config: the native engine's decode-side handover (a KV transfer agent
over the engine's KV cache, to receive prefill workers' KV) and the Generate service, whose prefill peers come
from membership. A colocated worker (`both`) is the same service without a handover: it always prefills locally.
With the KV pool, local prefills load what pays from it first (`PooledEngine`)."""

from __future__ import annotations

import asyncio
import logging

from splitserve.common.config import ClusterSpec
from splitserve.common.worker_client import GrpcWorkerClient
from splitserve.common.worker_context import WorkerContext
from splitserve.decode_worker.metrics import (
    HANDOVER_STAGE,
    HANDOVER_STAGES,
    LOCAL_PREFILL,
    LOCAL_PREFILL_REASONS,
    RESERVE_WAIT_OUTCOMES,
    RESERVE_WAITS,
)
from splitserve.decode_worker.service import DecodeService
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.interface import DecodeHandover, ServingEngine
from splitserve.kv_transfer import metrics as kv_metrics
from splitserve.kv_transfer.handover import NativeDecodeHandover
from splitserve.kv_transfer.pool import KVPool, PooledEngine, make_pool
from splitserve.kv_transfer.sharded import make_worker_agent

log = logging.getLogger("splitserve.decode_worker")


async def build(spec: ClusterSpec, engine: AsyncEngine, ctx: WorkerContext) -> DecodeService:
    if spec.engine_of("decode") == "vllm":  # a KV connector inside vLLM moves the KV (vllm.connector)
        from splitserve.vllm_engine.handovers import decode_handover

        _label_series(with_handover=True)
        return _service(spec, engine, decode_handover(spec, engine), ctx)
    # one agent per tensor-parallel rank, each over its own KV shard, composed on this rank (rank 0)
    agent = await asyncio.to_thread(make_worker_agent, spec.kv_transfer.backend, engine, ctx.host, "decode")
    log.info("kv transfer agent %s on %s", agent.name, agent.backend.name)
    kv_metrics.BYTES.labels("recv", agent.backend.name)
    _label_series(with_handover=True)
    pool = make_pool(spec, engine, ctx, "decode")
    return _service(spec, _serving(engine, pool), NativeDecodeHandover(engine, agent), ctx, pool)


async def build_colocated(spec: ClusterSpec, engine: AsyncEngine, ctx: WorkerContext) -> DecodeService:
    if spec.engine_of("both") == "vllm":
        return _service(spec, engine, None, ctx)
    pool = make_pool(spec, engine, ctx, "decode")
    return _service(spec, _serving(engine, pool), None, ctx, pool)


def _service(spec: ClusterSpec, engine: ServingEngine, handover: DecodeHandover | None, ctx: WorkerContext,
             pool: KVPool | None = None) -> DecodeService:
    """The service over its prefill peers in membership, each called over gRPC; it closes the pool."""
    return DecodeService(engine, handover, ctx.membership, GrpcWorkerClient, spec.decode.disagg_threshold,
                         spec.kv_transfer.timeout_seconds, [] if pool is None else [pool],
                         spec.decode.reserve_wait_seconds)


def _label_series(with_handover: bool) -> None:
    for reason in LOCAL_PREFILL_REASONS:  # every series from the start, so dashboards see them
        LOCAL_PREFILL.labels(reason)
    if with_handover:  # only a decode worker hands over (a colocated one lists none)
        for stage in HANDOVER_STAGES:
            HANDOVER_STAGE.labels(stage)
        for outcome in RESERVE_WAIT_OUTCOMES:
            RESERVE_WAITS.labels(outcome)


def _serving(engine: AsyncEngine, pool: KVPool | None) -> ServingEngine:
    return engine if pool is None else PooledEngine(engine, pool)
