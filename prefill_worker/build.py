"""A prefill worker assembles itself from config: a KV transfer agent over the engine's KV cache, the layer hook
that streams each layer as it is written, and the Prefill service."""

from __future__ import annotations

import asyncio
import logging

from splitserve.common.config import ClusterSpec
from splitserve.common.membership import Membership
from splitserve.engine.interface import ServingEngine
from splitserve.kv_transfer import KVLayout, make_agent
from splitserve.kv_transfer import metrics as kv_metrics
from splitserve.kv_transfer.stream_hook import KVStreamHook
from splitserve.prefill_worker.service import PrefillService

log = logging.getLogger("splitserve.prefill_worker")


async def build(spec: ClusterSpec, engine: ServingEngine, membership: Membership, host: str) -> PrefillService:
    agent = await asyncio.to_thread(make_agent, spec.kv_transfer.backend, KVLayout(engine.kv_tensors()), host)
    log.info("kv transfer agent %s on %s", agent.name, agent.backend.name)
    kv_metrics.BYTES.labels("send", agent.backend.name)
    hook = KVStreamHook(engine.kv_spec.block_size, cuda=engine.facts.device.startswith("cuda"))
    engine.add_layer_hook(hook)
    return PrefillService(engine, agent, hook)
