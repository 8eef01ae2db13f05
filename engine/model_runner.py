"""Runs one scheduled step on the model: packs the batch, builds attention metadata, samples."""

from __future__ import annotations

from typing import Protocol

import torch

from splitserve.engine.attention import AttentionMetadata, PrefillSeq
from splitserve.engine.kv_cache_manager import cdiv
from splitserve.engine.models.arch import ArchConfig
from splitserve.engine.models.llama import CausalLM
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import SampledToken, ScheduledRequest, SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVLayerHook(Protocol):
    """Told, layer by layer, that this step's KV is written (the prefill side of KV streaming).

    `on_layer_written` runs on the engine thread right after layer i wrote its K/V for the batch; on CUDA the
    write is queued on the current stream, so a hook that hands the memory to another stream or agent
    records a CUDA event there and waits on it before reading.
    """

    def on_step_begin(self, scheduled: list[ScheduledRequest]) -> None: ...

    def on_layer_written(self, layer_idx: int) -> None: ...

    def on_step_end(self, scheduled: list[ScheduledRequest]) -> None: ...


class ModelRunner:
    def __init__(self, model: CausalLM, arch: ArchConfig, device: torch.device, dtype: torch.dtype,
                 block_size: int, seed: int = 0, cuda_graphs: bool = True, max_model_len: int = 4096,
                 max_num_seqs: int = 128) -> None:
        self.model = model
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.sampler = Sampler(seed)
        if device.type == "cpu":
            from splitserve.engine.kernels.cpu_linear import pack_linears

            pack_linears(model)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # the MoE expert loop reads routing counts on the host, which a graph cannot capture
        self.use_graphs = cuda_graphs and device.type == "cuda" and not arch.is_moe
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.graphs = None

    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.arch.num_layers * self.block_size * self.arch.num_kv_heads * self.arch.head_dim * itemsize

    def init_kv_cache(self, num_blocks: int) -> None:
        # on CUDA one extra scratch block takes the (ignored) writes of padded CUDA-graph rows
        shape = (num_blocks + int(self.use_graphs), self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.arch.num_layers)
        ]
        if self.use_graphs:
            from splitserve.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_caches, num_blocks, self.block_size,
                                       cdiv(self.max_model_len, self.block_size), self.max_num_seqs, self.device)
            self.graphs.capture()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, hook: KVLayerHook | None = None) -> dict[str, SampledToken]:
        if self.graphs is not None and hook is None and len(sched.scheduled) <= self.graphs.max_batch \
                and all(s.num_new_tokens == 1 for s in sched.scheduled):
            return self._execute_graph(sched)
        # Decodes (one new token) first, so their attention runs as one batched gather.
        order = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        meta, input_ids, positions, sample_idx = self._prepare(order)
        if hook is not None:
            hook.on_step_begin(order)
            meta.on_layer_written = hook.on_layer_written
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if hook is not None:
            hook.on_step_end(order)
        sampling = [s.request for s in order if s.sample]
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[sample_idx])
        tokens = self.sampler.sample(logits, sampling)
        return {r.request_id: t for r, t in zip(sampling, tokens, strict=True)}

    def _execute_graph(self, sched: SchedulerOutput) -> dict[str, SampledToken]:
        bs = self.block_size
        items = sched.scheduled
        logits = self.graphs.run(
            [s.request.token_slice(s.start, s.start + 1)[0] for s in items],
            [s.start for s in items],
            [s.block_ids[s.start // bs] * bs + s.start % bs for s in items],
            [s.block_ids for s in items],
            [s.start + 1 for s in items],
        )
        rows = [i for i, s in enumerate(items) if s.sample]
        if not rows:
            return {}
        sampling = [items[i].request for i in rows]
        tokens = self.sampler.sample(logits[rows].float(), sampling)
        return {r.request_id: t for r, t in zip(sampling, tokens, strict=True)}

    def _prepare(self, order: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[torch.Tensor] = []
        slot_chunks: list[torch.Tensor] = []
        sample_idx: list[int] = []
        prefills: list[PrefillSeq] = []
        num_decodes = sum(1 for s in order if s.num_new_tokens == 1)
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        for s in order:
            n = s.num_new_tokens
            ids.extend(s.request.token_slice(s.start, s.start + n))
            pos = torch.arange(s.start, s.start + n)
            table = torch.tensor(s.block_ids, dtype=torch.long)
            pos_chunks.append(pos)
            slot_chunks.append(table[pos // bs] * bs + pos % bs)
            token_start = len(ids) - n
            if n == 1:
                dec_tables.append(s.block_ids)
                dec_lens.append(s.start + 1)
            else:
                num_blocks = cdiv(s.start + n, bs)
                prefills.append(PrefillSeq(token_start, n, s.start, table[:num_blocks].to(self.device)))
            if s.sample:
                sample_idx.append(token_start + n - 1)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.cat(slot_chunks).to(dev), block_size=bs,
                                 num_decodes=num_decodes, prefills=prefills)
        if num_decodes:
            width = max(len(t) for t in dec_tables)
            padded = [t + [0] * (width - len(t)) for t in dec_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long).to(dev)
            meta.decode_seq_lens = torch.tensor(dec_lens, dtype=torch.long).to(dev)
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev)
        positions = torch.cat(pos_chunks).to(dev)
        return meta, input_ids, positions, torch.tensor(sample_idx, dtype=torch.long).to(dev)
