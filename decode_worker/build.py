"""A decode worker assembles itself from config: its engine's decode-side handover (`splitserve.common.engines`
names the module that builds it: the native engine's KV transfer agent over its KV cache, or vLLM's KV
connector) and the Generate service, whose prefill peers come from membership. A colocated worker (`both`) is
the same service without a handover: it always prefills locally. The engine's side may put something in front
of the engine (the native engine's KV pool, `PooledEngine`), which the service closes with it."""

from __future__ import annotations

from splitserve.common import engines
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
from splitserve.engine.interface import DecodeSide, ServingEngine


async def build(spec: ClusterSpec, engine: ServingEngine, ctx: WorkerContext) -> DecodeService:
    sides = engines.get(spec.engine_of("decode")).resolve_handovers()
    side = await sides.decode_side(spec, engine, ctx)
    _label_series(with_handover=True)
    return _service(spec, side, ctx)


async def build_colocated(spec: ClusterSpec, engine: ServingEngine, ctx: WorkerContext) -> DecodeService:
    sides = engines.get(spec.engine_of("both")).resolve_handovers()
    return _service(spec, await sides.colocated_side(spec, engine, ctx), ctx)


def _service(spec: ClusterSpec, side: DecodeSide, ctx: WorkerContext) -> DecodeService:
    """The service over its prefill peers in membership, each called over gRPC; it closes the side's resources."""
    return DecodeService(side.engine, side.handover, ctx.membership, GrpcWorkerClient, spec.decode.disagg_threshold,
                         spec.kv_transfer.timeout_seconds, side.resources, spec.decode.reserve_wait_seconds)


def _label_series(with_handover: bool) -> None:
    for reason in LOCAL_PREFILL_REASONS:  # every series from the start, so dashboards see them
        LOCAL_PREFILL.labels(reason)
    if with_handover:  # only a decode worker hands over (a colocated one lists none)
        for stage in HANDOVER_STAGES:
            HANDOVER_STAGE.labels(stage)
        for outcome in RESERVE_WAIT_OUTCOMES:
            RESERVE_WAITS.labels(outcome)
