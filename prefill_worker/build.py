"""A prefill worker assembles itself from config: the native engine's prefill-side handover (a KV transfer agent
over the engine's KV cache, the layer hook that streams each layer as it is written, the KV pool if enabled)
and the Prefill service, which sees only the handover seam."""

from __future__ import annotations

import asyncio
import logging

from splitserve.common.config import ClusterSpec
from splitserve.common.worker_context import WorkerContext
from splitserve.engine.async_engine import AsyncEngine
from splitserve.kv_transfer import metrics as kv_metrics
from splitserve.kv_transfer.handover import NativePrefillHandover
from splitserve.kv_transfer.pool import make_pool
from splitserve.kv_transfer.sharded import make_worker_agent
from splitserve.kv_transfer.stream_hook import KVStreamHook
from splitserve.prefill_worker.metrics import PREFILL_STAGE, PREFILL_STAGES
from splitserve.prefill_worker.service import PrefillService

log = logging.getLogger("splitserve.prefill_worker")


async def build(spec: ClusterSpec, engine: AsyncEngine, ctx: WorkerContext) -> PrefillService:
    if spec.engine_of("prefill") == "vllm":
        return _build_vllm(spec, engine)
    # one agent per tensor-parallel rank, each over its own KV shard, composed on this rank (rank 0)
    agent = await asyncio.to_thread(make_worker_agent, spec.kv_transfer.backend, engine, ctx.host, "prefill")
    log.info("kv transfer agent %s on %s", agent.name, agent.backend.name)
    kv_metrics.BYTES.labels("send", agent.backend.name)
    for stage in PREFILL_STAGES:  # every series from the start, so dashboards see them
        PREFILL_STAGE.labels(stage)
    hook = KVStreamHook(engine.kv_spec.block_size, cuda=engine.facts.device.startswith("cuda"))
    engine.add_layer_hook(hook)
    handover = NativePrefillHandover(engine, agent, hook, make_pool(spec, engine, ctx, "prefill"))
    return PrefillService(engine, handover)


def _build_vllm(spec: ClusterSpec, engine) -> PrefillService:
    """engine vllm: a KV connector inside this worker's vLLM server moves the prompt's KV (vllm.connector)."""
    from splitserve.vllm_engine.handovers import prefill_handover

    for stage in PREFILL_STAGES:
        PREFILL_STAGE.labels(stage)
    return PrefillService(engine, prefill_handover(spec, engine))
