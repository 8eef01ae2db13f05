"""A prefill worker assembles itself from config: a KV transfer agent over the engine's KV cache, the layer hook
that streams each layer as it is written, the KV pool if enabled, and the Prefill service."""

from __future__ import annotations

import asyncio
import logging

from splitserve.common.config import ClusterSpec
from splitserve.common.worker_context import WorkerContext
from splitserve.engine.interface import ServingEngine
from splitserve.kv_transfer import metrics as kv_metrics
from splitserve.kv_transfer.pool import make_pool
from splitserve.kv_transfer.sharded import make_worker_agent
from splitserve.kv_transfer.stream_hook import KVStreamHook
from splitserve.prefill_worker.metrics import PREFILL_STAGE, PREFILL_STAGES
from splitserve.prefill_worker.service import PrefillService

log = logging.getLogger("splitserve.prefill_worker")


async def build(spec: ClusterSpec, engine: ServingEngine, ctx: WorkerContext) -> PrefillService:
    # one agent per tensor-parallel rank, each over its own KV shard, composed on this rank (rank 0)
    agent = await asyncio.to_thread(make_worker_agent, spec.kv_transfer.backend, engine, ctx.host, "prefill")
    log.info("kv transfer agent %s on %s", agent.name, agent.backend.name)
    kv_metrics.BYTES.labels("send", agent.backend.name)
    for stage in PREFILL_STAGES:  # every series from the start, so dashboards see them
        PREFILL_STAGE.labels(stage)
    hook = KVStreamHook(engine.kv_spec.block_size, cuda=engine.facts.device.startswith("cuda"))
    engine.add_layer_hook(hook)
    return PrefillService(engine, agent, hook, make_pool(spec, engine, ctx, "prefill"))
