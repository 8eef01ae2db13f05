"""A prefill worker assembles itself from config: its engine's prefill-side handover (`splitserve.common.engines`
names the module that builds it: the native engine's KV transfer agent, layer hook and KV pool, or vLLM's KV
connector) and the Prefill service, which sees only the handover seam."""

from __future__ import annotations

from splitserve.common import engines
from splitserve.common.config import ClusterSpec
from splitserve.common.worker_context import WorkerContext
from splitserve.engine.interface import ServingEngine
from splitserve.prefill_worker.metrics import PREFILL_STAGE, PREFILL_STAGES
from splitserve.prefill_worker.service import PrefillService


async def build(spec: ClusterSpec, engine: ServingEngine, ctx: WorkerContext) -> PrefillService:
    sides = engines.get(spec.engine_of("prefill")).resolve_handovers()
    handover = await sides.prefill_side(spec, engine, ctx)
    for stage in PREFILL_STAGES:  # every series from the start, so dashboards see them
        PREFILL_STAGE.labels(stage)
    return PrefillService(engine, handover)
