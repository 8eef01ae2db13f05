"""The handover pair a vLLM worker runs beside its server, as its KV connector (`connectors`) names it, and the
sides each role assembles on engine vllm (`splitserve.common.engines`): the KV moves inside the servers, so no
pool or agent sits in front of the engine here."""

from __future__ import annotations

from splitserve.common.config import ClusterSpec
from splitserve.common.worker_context import WorkerContext
from splitserve.engine.interface import DecodeHandover, DecodeSide, PrefillHandover
from splitserve.vllm_engine.connectors import connector
from splitserve.vllm_engine.engine import VllmEngine


def decode_handover(spec: ClusterSpec, engine: VllmEngine) -> DecodeHandover:
    if connector(spec).handover == "layerwise":
        from splitserve.vllm_engine.layerwise_handover import VllmLayerwiseDecodeHandover

        if engine.control is None:
            raise ValueError("vllm.connector layerwise: this worker's vLLM server has no control line")
        return VllmLayerwiseDecodeHandover(engine, engine.control, engine.side_channel[0], engine.side_channel[1])
    from splitserve.vllm_engine.pull_handover import VllmDecodeHandover

    return VllmDecodeHandover(engine)


def prefill_handover(spec: ClusterSpec, engine: VllmEngine) -> PrefillHandover:
    if connector(spec).handover == "layerwise":
        from splitserve.vllm_engine.layerwise_handover import VllmLayerwisePrefillHandover

        if engine.control is None:
            raise ValueError("vllm.connector layerwise: this worker's vLLM server has no control line")
        return VllmLayerwisePrefillHandover(engine, engine.control)
    from splitserve.vllm_engine.pull_handover import VllmPrefillHandover

    return VllmPrefillHandover(engine)


async def prefill_side(spec: ClusterSpec, engine: VllmEngine, ctx: WorkerContext) -> PrefillHandover:
    return prefill_handover(spec, engine)


async def decode_side(spec: ClusterSpec, engine: VllmEngine, ctx: WorkerContext) -> DecodeSide:
    return DecodeSide(engine, decode_handover(spec, engine))


async def colocated_side(spec: ClusterSpec, engine: VllmEngine, ctx: WorkerContext) -> DecodeSide:
    return DecodeSide(engine, None)
