"""A decode worker assembles itself from config: a KV transfer agent over the engine's KV cache (to receive
prefill workers' KV) and the Generate service, whose prefill peers come from membership. A colocated worker
(`both`) is the same service without an agent: it always prefills locally."""

from __future__ import annotations

import asyncio
import logging

from splitserve.common.config import ClusterSpec
from splitserve.common.worker_context import WorkerContext
from splitserve.decode_worker.metrics import (
    HANDOVER_STAGE,
    HANDOVER_STAGES,
    LOCAL_PREFILL,
    LOCAL_PREFILL_REASONS,
)
from splitserve.decode_worker.service import DecodeService
from splitserve.engine.interface import ServingEngine
from splitserve.kv_transfer import metrics as kv_metrics
from splitserve.kv_transfer.pool import make_pool
from splitserve.kv_transfer.sharded import make_worker_agent

log = logging.getLogger("splitserve.decode_worker")


async def build(spec: ClusterSpec, engine: ServingEngine, ctx: WorkerContext) -> DecodeService:
    # one agent per tensor-parallel rank, each over its own KV shard, composed on this rank (rank 0)
    agent = await asyncio.to_thread(make_worker_agent, spec.kv_transfer.backend, engine, ctx.host, "decode")
    log.info("kv transfer agent %s on %s", agent.name, agent.backend.name)
    kv_metrics.BYTES.labels("recv", agent.backend.name)
    for reason in LOCAL_PREFILL_REASONS:  # every series from the start, so dashboards see them
        LOCAL_PREFILL.labels(reason)
    for stage in HANDOVER_STAGES:  # only a decode worker hands over (a colocated one lists none)
        HANDOVER_STAGE.labels(stage)
    return DecodeService(engine, agent, ctx.membership, spec.decode.disagg_threshold,
                         spec.kv_transfer.timeout_seconds, make_pool(spec, engine, ctx, "decode"))


async def build_colocated(spec: ClusterSpec, engine: ServingEngine, ctx: WorkerContext) -> DecodeService:
    return DecodeService(engine, None, ctx.membership, spec.decode.disagg_threshold,
                         spec.kv_transfer.timeout_seconds, make_pool(spec, engine, ctx, "decode"))
