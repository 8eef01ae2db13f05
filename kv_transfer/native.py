"""The native engine as a worker runs it (engine `native` in `splitserve.common.engines`): its load (the model in
an `AsyncEngine`, every tensor-parallel rank streaming its own KV shard) and the handover sides each role
assembles on it: a KV transfer agent over the engine's KV cache (the prefill side's layer hook streams each
layer as it is written), and the KV pool in front of local prefills."""

from __future__ import annotations

import asyncio
import logging

from splitserve.common.config import ClusterSpec
from splitserve.common.worker_context import WorkerContext
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.interface import DecodeSide, PrefillHandover, ServingEngine
from splitserve.kv_transfer import metrics as kv_metrics
from splitserve.kv_transfer.handover import NativeDecodeHandover, NativePrefillHandover
from splitserve.kv_transfer.pool import KVPool, PooledEngine, make_pool
from splitserve.kv_transfer.sharded import make_worker_agent
from splitserve.kv_transfer.stream_hook import KVStreamHook

log = logging.getLogger("splitserve.kv_transfer")


async def load(spec: ClusterSpec, role: str, advertise_host: str, attach_url: str | None = None,
               stop: asyncio.Event | None = None) -> AsyncEngine:
    """Load the model with the role's engine settings (in a thread; a stop does not end it)."""
    return await asyncio.to_thread(load_engine, spec, role)


def load_engine(spec: ClusterSpec, role: str) -> AsyncEngine:
    from splitserve.engine.host_memory import bound_host_memory

    bound_host_memory()
    import torch

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


async def prefill_side(spec: ClusterSpec, engine: AsyncEngine, ctx: WorkerContext) -> PrefillHandover:
    # one agent per tensor-parallel rank, each over its own KV shard, composed on this rank (rank 0)
    agent = await asyncio.to_thread(make_worker_agent, spec.kv_transfer.backend, engine, ctx.host, "prefill")
    log.info("kv transfer agent %s on %s", agent.name, agent.backend.name)
    kv_metrics.BYTES.labels("send", agent.backend.name)
    hook = KVStreamHook(engine.kv_spec.block_size, cuda=engine.facts.device.startswith("cuda"))
    engine.add_layer_hook(hook)
    return NativePrefillHandover(engine, agent, hook, await make_pool(spec, engine, ctx, "prefill"))


async def decode_side(spec: ClusterSpec, engine: AsyncEngine, ctx: WorkerContext) -> DecodeSide:
    # one agent per tensor-parallel rank, each over its own KV shard, composed on this rank (rank 0)
    agent = await asyncio.to_thread(make_worker_agent, spec.kv_transfer.backend, engine, ctx.host, "decode")
    log.info("kv transfer agent %s on %s", agent.name, agent.backend.name)
    kv_metrics.BYTES.labels("recv", agent.backend.name)
    pool = await make_pool(spec, engine, ctx, "decode")
    return DecodeSide(_serving(engine, pool), NativeDecodeHandover(engine, agent), _closed(pool))


async def colocated_side(spec: ClusterSpec, engine: AsyncEngine, ctx: WorkerContext) -> DecodeSide:
    pool = await make_pool(spec, engine, ctx, "decode")
    return DecodeSide(_serving(engine, pool), None, _closed(pool))


def _serving(engine: AsyncEngine, pool: KVPool | None) -> ServingEngine:
    """With the KV pool, local prefills load what pays from it first."""
    return engine if pool is None else PooledEngine(engine, pool)


def _closed(pool: KVPool | None) -> list[KVPool]:
    return [] if pool is None else [pool]
