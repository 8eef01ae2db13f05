"""The KV pool inside a vLLM server: a KV connector (vLLM's `KVConnectorBase_V1`) on the pool's wire format,
loaded by `--kv-transfer-config` (`kv_connector_module_path`; behind the NixlConnector in a `MultiConnector` for
disaggregated roles). It runs in vLLM's processes, not in the worker beside it, and is the one module of this
package that imports vLLM and torch.

Scheduler side (`PoolPlanner`): when a request is first scheduled, the leading run of its prompt's full blocks
in the pool beyond what vLLM holds (one pipelined EXISTS with a short deadline; Redis down: 0), the last token
always left to compute; each step, the full blocks the step completes, to store. Worker side: before the
forward, one pipelined GET per request, each block's header and checksum checked, the intact leading run
scattered into the blocks vLLM reserved; a block missing, corrupt or not read in time is reported to vLLM
(`get_block_ids_with_load_errors`; the server runs with `kv_load_failure_policy: recompute`), which recomputes
from it. After the forward, the blocks to store are copied out of the cache and a writer thread stores those the
pool lacks (with a TTL) and adds a `pool`-tier event to the model's KV event stream, as native workers do.

A block's payload is its bytes in each layer's cache tensor, layer after layer, in vLLM's layout for this device
(the namespace's layout tag): a round trip is exact, and workers of another layout never read it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from splitserve.common.redis_wire import ChecksumError, KVEventRecord, PoolNamespace, WireError
from splitserve.vllm_engine.in_vllm import resumed_req_ids
from splitserve.vllm_engine.in_vllm.layerwise_wire import PARAMS_KEY as LAYERWISE_PARAMS
from splitserve.vllm_engine.in_vllm.pool_plan import (
    BlockLoad,
    PoolPlanner,
    PoolSettings,
    PoolStep,
    RedisHandle,
    StatsDelta,
    pipelined,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("splitserve.vllm_pool")

FLUSH_S = 1.0  # stats flushed to Redis at most this often
EVENTS_MAXLEN = 200_000  # the model's KV event stream, trimmed approximately (as native workers trim it)


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    step: PoolStep


def namespace(vllm_config: VllmConfig, model: str, tp_rank: int) -> PoolNamespace:
    """The pool namespace of this server's KV layout (the same on the scheduler and worker sides)."""
    from vllm.platforms import current_platform

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if cc.cache_dtype != "auto":
        raise ValueError(f"the KV pool stores the model's dtype; --kv-cache-dtype {cc.cache_dtype} is not supported")
    dtype = str(mc.dtype).removeprefix("torch.")
    return PoolNamespace(model, dtype, cc.block_size, mc.get_num_layers(pc), mc.get_num_kv_heads(pc),
                         mc.get_head_size(), tp_rank, pc.tensor_parallel_size,
                         layout=f"vllm-{current_platform.device_type}")


class SplitservePoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = PoolSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError("the KV pool does not store tensor-parallel shards (tensorParallelSize > 1)")
        if len(getattr(kv_cache_config, "kv_cache_groups", ()) or ()) > 1:  # our hashes name one chain of blocks
            raise ValueError("the KV pool stores models with one KV cache group only (no hybrid or sliding-window "
                             "attention layers)")
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = getattr(kv_cache_config, "num_blocks", 0)
        self.ns = namespace(vllm_config, self.settings.model, 0)
        self.stats = StatsDelta()
        self._load_errors: set[int] = set()
        self._layers: list[tuple[torch.Tensor, int]] = []  # (a layer's cache, its block axis)
        if role == KVConnectorRole.SCHEDULER:
            self._lookups = RedisHandle(None, self.settings.lookup_timeout_seconds)
            self.planner = PoolPlanner(self.block_size, self.settings.model, self.settings.min_load_tokens,
                                       self.settings.write, self._exists)
        else:
            self._redis = RedisHandle(None, self.settings.read_timeout_seconds)
            self._queue: queue.Queue[tuple[list[int], torch.Tensor] | None] = queue.Queue()
            self._queued_blocks = 0
            self._lock = threading.Lock()
            self._writer = threading.Thread(target=self._write_loop, name="splitserve-pool-writer", daemon=True)
            self._writer.start()
        log.info("KV pool connector (%s): %s, writes %s", role.name.lower(), self.ns.prefix,
                 "on" if self.settings.write else "off")

    # == scheduler side ========================================================================================
    def _exists(self, hashes: list[int]) -> list[bool] | None:
        keys = [self.ns.key(h) for h in hashes]
        found = self._lookups.call(lambda r: pipelined(r, "exists", keys))
        return None if found is None else [bool(f) for f in found]

    @staticmethod
    def _poolable(request: Request) -> bool:
        """Our hashes name token ids only: requests whose KV depends on more (LoRA, images, a cache salt) and
        those whose KV comes from a prefill server (a NixlConnector's pull, the layerwise push) stay out of the
        pool."""
        params = getattr(request, "kv_transfer_params", None) or {}
        pushed = (params.get(LAYERWISE_PARAMS) or {}).get("role") == "consumer"  # the layerwise connector's
        return not (getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
                    or getattr(request, "cache_salt", None) or params.get("do_remote_prefill") or pushed)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._poolable(request):
            return 0, False
        return self.planner.lookup(request.request_id, list(request.prompt_token_ids or ()), num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if not self._poolable(request):
            return
        self.planner.allocated(request.request_id, request.all_token_ids, blocks.get_block_ids()[0],
                               num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        scheduled = [(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens.get(r.req_id, 0), r.block_ids[0], True)
                     for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            scheduled.append((req_id, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(req_id, 0),
                              None if new_ids is None else new_ids[0], req_id in resumed))
        return PoolConnectorMetadata(self.planner.step(scheduled))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None

    # == worker side ===========================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Each layer's cache has the blocks on axis 0 ([num_blocks, ...], vLLM 0.32) or 1 ([2, num_blocks, ...]:
        K and V apart); a block is 2 x block_size x KV heads x head dim values either way."""
        per_block = self.ns.payload_bytes // self.ns.num_layers
        layers = []
        for name, kv in kv_caches.items():
            axis = 0 if kv.shape[0] == self.num_blocks else 1 if kv.ndim > 1 and kv.shape[1] == self.num_blocks \
                else -1
            if axis < 0 or kv[(slice(None),) * axis + (0,)].numel() * kv.element_size() != per_block:
                raise ValueError(f"the KV pool cannot read layer {name}'s cache {tuple(kv.shape)} {kv.dtype} "
                                 f"({self.num_blocks} blocks of {per_block} bytes expected)")
            layers.append((kv, axis))
        if len(layers) != self.ns.num_layers:
            raise ValueError(f"the KV pool expects {self.ns.num_layers} attention layers, vLLM has {len(layers)}")
        self._layers = layers

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        if meta.step.lookup_tokens:
            self.stats.add("lookup_tokens", meta.step.lookup_tokens)
        for load in meta.step.loads:
            self._load(load)

    def _load(self, load: BlockLoad) -> None:
        t0 = time.monotonic()
        keys = [self.ns.key(h) for h in load.block_hashes]
        raws = self._redis.call(lambda r: pipelined(r, "get", keys))
        payloads: list[memoryview] = []
        if raws is None:
            self.stats.add(f"errors_{self._redis.last_error}")  # not read in time, or Redis unreachable
        else:
            for key, raw in zip(keys, raws, strict=True):
                reason = None
                try:
                    if raw is None:
                        reason = "errors_missing"  # evicted since the lookup
                    else:
                        payloads.append(self.ns.decode_block(raw))
                except ChecksumError:
                    reason = "errors_checksum"
                except WireError:
                    reason = "errors_header"
                if reason is not None:
                    self.stats.add(reason)
                    if raw is not None:  # a bad block goes, so that the next worker computing it stores it again
                        self._redis.call(lambda r, k=key: r.delete(k))
                    break
        n = len(payloads)
        if n:
            data = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(n, -1)
            self._scatter(list(load.block_ids[:n]), torch.from_numpy(data.copy()))
        self._load_errors.update(load.block_ids[n:])  # vLLM recomputes from the first of these
        self.stats.add("hit_tokens", n * self.block_size)
        self.stats.add("bytes_read", n * self.ns.payload_bytes)
        self.stats.add("read_seconds", time.monotonic() - t0)

    def _scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """`data`: [n, payload bytes] -> these blocks of every layer."""
        n = len(block_ids)
        per_layer = data.view(n, self.ns.num_layers, -1)
        for i, (kv, axis) in enumerate(self._layers):
            idx = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            block_shape = kv[(slice(None),) * axis + (0,)].shape
            src = per_layer[:, i].contiguous().view(kv.dtype).view(n, *block_shape).to(kv.device)
            kv.index_copy_(axis, idx, src.movedim(0, axis))

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """These blocks of every layer as [n, payload bytes] on the host (a copy)."""
        n = len(block_ids)
        parts = []
        for kv, axis in self._layers:
            idx = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            parts.append(kv.index_select(axis, idx).movedim(axis, 0).reshape(n, -1).cpu())
        return torch.stack(parts, dim=1).contiguous().view(torch.uint8).view(n, -1)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are copied once the forward is done (`wait_for_save`)

    def wait_for_save(self):
        """Copy the blocks this step completed out of the cache (before vLLM can reuse them) and queue them
        for the writer; past `writeQueueBlocks` waiting, new ones are dropped and counted, never waited for."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        step = meta.step
        if not step.save_block_ids or not self._layers:
            return
        with self._lock:
            room = max(0, self.settings.write_queue_blocks - self._queued_blocks)
            take = min(room, len(step.save_block_ids))
            self._queued_blocks += take
        if take < len(step.save_block_ids):
            self.stats.add("errors_dropped", len(step.save_block_ids) - take)
        if take:
            self._queue.put((step.save_hashes[:take], self._gather(step.save_block_ids[:take])))

    def _write_loop(self) -> None:
        last_flush = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:
                item = None
            else:
                if item is None:
                    break
                hashes, data = item
                with self._lock:
                    self._queued_blocks -= len(hashes)
                self._write(hashes, data)
            if time.monotonic() - last_flush >= FLUSH_S:
                last_flush = time.monotonic()
                self.stats.flush(self._redis, self.settings.stats_key)
        self.stats.flush(self._redis, self.settings.stats_key)

    def _write(self, hashes: list[int], data: torch.Tensor) -> None:
        """Store the blocks the pool lacks, then tell the gateways (a `pool`-tier event)."""
        t0 = time.monotonic()
        keys = [self.ns.key(h) for h in hashes]
        found = self._redis.call(lambda r: pipelined(r, "exists", keys))
        if found is None:
            self.stats.add("errors_redis")
            return
        todo = [i for i, f in enumerate(found) if not f]
        self.stats.add("blocks_skipped", len(hashes) - len(todo))
        if not todo:
            return
        raw = data.numpy()
        values = [self.ns.encode_block(raw[i].data) for i in todo]
        stored = [hashes[i] for i in todo]
        record = KVEventRecord(self.settings.worker, self.settings.instance_id, "stored", "pool",
                               np.asarray(stored, dtype=np.uint64))
        ttl = self.settings.ttl_seconds

        def store(r) -> bool:
            from redis.exceptions import OutOfMemoryError

            pipe = r.pipeline(transaction=False)
            for h, v in zip(stored, values, strict=True):
                pipe.set(self.ns.key(h), v, ex=ttl)
            try:
                pipe.execute()
            except OutOfMemoryError:  # maxmemory reached with nothing left to evict: these stay unpooled
                return False
            r.xadd(self.settings.events_key, record.encode(), maxlen=EVENTS_MAXLEN, approximate=True)
            return True

        if not self._redis.call(store, False):
            self.stats.add("errors_redis")
            return
        self.stats.add("blocks_written", len(stored))
        self.stats.add("bytes_written", sum(len(v) for v in values))
        self.stats.add("write_seconds", time.monotonic() - t0)

    def shutdown(self):
        if self.role == KVConnectorRole.WORKER:
            self._queue.put(None)
            self._writer.join(timeout=5)

