"""The layer-wise push KV connector (vLLM's `KVConnectorBase_V1`), loaded by `--kv-transfer-config`
(`kv_connector_module_path`; in a `MultiConnector` before the KV pool's connector when both are on). The same class
runs on a prefill server and a decode server; which part acts is the request's (its `kv_transfer_params`, written
by the worker beside vLLM). The scheduler side is `layerwise_plan`, the worker side `layerwise_mover`.

Written against vLLM's connector API as 0.26 and 0.32 have it in common: `get_finished` (not the newer
`get_transfer_results`), failed loads as block ids (`get_block_ids_with_load_errors`, the server runs with
`kv_load_failure_policy: recompute`), and the request's own `kv_transfer_params`. What it cannot do yet it refuses
when the server starts, with one line: pipeline parallelism, several KV cache groups (hybrid or sliding-window
models), and (per transfer, at the prefill side) a decode server of another tensor-parallel size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from splitserve.vllm_engine.in_vllm import resumed_req_ids, setup_logging
from splitserve.vllm_engine.in_vllm.control_link import ControlLink
from splitserve.vllm_engine.in_vllm.layerwise_plan import LayerwisePlanner, LayerwiseStepPlan
from splitserve.vllm_engine.in_vllm.layerwise_wire import LayerwiseSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("splitserve.vllm_layerwise")


@dataclass
class LayerwiseConnectorMetadata(KVConnectorMetadata):
    plan: LayerwiseStepPlan


class SplitserveLayerwiseConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        setup_logging()
        ktc = self._kv_transfer_config
        self.settings = LayerwiseSettings.from_extra(ktc.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ValueError("the layerwise KV connector does not move pipeline-parallel stages (use kvTransfer "
                             "connector pull)")
        groups = getattr(kv_cache_config, "kv_cache_groups", ()) or ()
        if len(groups) > 1:
            raise ValueError("the layerwise KV connector moves models with one KV cache group only (no hybrid or "
                             "sliding-window attention layers; use kvTransfer connector pull)")
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = str(ktc.engine_id)
        self.dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        self.tp_size = pc.tensor_parallel_size
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        if role == KVConnectorRole.SCHEDULER:
            self.link = ControlLink(self.settings.control, "scheduler", self.dp_rank, 0, self.engine_id, None)
            self.planner = LayerwisePlanner(self.block_size, self.engine_id, self.dp_rank, self.tp_size,
                                            self.link.send)
            self.mover = None
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from splitserve.vllm_engine.in_vllm.layerwise_mover import LayerwiseMover

            self.mover = LayerwiseMover(self.settings, self.engine_id, self.dp_rank, get_tensor_model_parallel_rank(),
                                        self.tp_size, self.block_size, self.num_blocks)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between the graph's pieces, once per layer

    # == scheduler side ========================================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.planner.lookup(request.request_id, request.kv_transfer_params,
                                   len(request.prompt_token_ids or ()), num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        params = request.kv_transfer_params
        if self.planner.ours(params) is None:
            return
        self.planner.allocated(request.request_id, params, blocks.get_block_ids()[0], num_external_tokens,
                               len(request.prompt_token_ids or ()))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        new = [(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens.get(r.req_id, 0), r.block_ids[0])
               for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        rows = []
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            rows.append((req_id, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(req_id, 0),
                         None if new_ids is None else new_ids[0], req_id in resumed))
        idle = not getattr(so, "total_num_scheduled_tokens", 1)
        return LayerwiseConnectorMetadata(self.planner.step(new, rows, idle))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.planner.finished(request.request_id), None

    # == worker side ===========================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.mover.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.mover is not None and isinstance(connector_metadata, LayerwiseConnectorMetadata):
            self.mover.begin_step(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # senders write into our blocks; nothing to start here

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request runs only once all of its KV landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.mover.layer_saved(layer_name)

    def wait_for_save(self):
        self.mover.step_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, errors = self.mover.results(finished_req_ids)
        self._load_errors = getattr(self, "_load_errors", set()) | errors
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = getattr(self, "_load_errors", set()), set()
        return errors

    def shutdown(self):
        if self.mover is not None:
            self.mover.shutdown()
        elif getattr(self, "link", None) is not None:
            self.link.close()

