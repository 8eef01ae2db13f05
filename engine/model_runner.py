"""Runs one scheduled step on the model: packs the batch, builds attention metadata, samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.engine.attention import AttentionMetadata, PrefillSeq
from splitserve.engine.kv_cache_manager import cdiv
from splitserve.engine.models.arch import ArchConfig
from splitserve.engine.models.llama import CausalLM
from splitserve.engine.parallel import ParallelContext
from splitserve.engine.request import PENDING_TOKEN
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import SampledToken, ScheduledRequest, SchedulerOutput
from splitserve.engine.step_batch import Feed, PrefillChunk, StepBatch, send_step

if TYPE_CHECKING:
    from splitserve.engine.layer_hooks import KVLayerHook

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, model: CausalLM, arch: ArchConfig, device: torch.device, dtype: torch.dtype,
                 block_size: int, seed: int = 0, cuda_graphs: bool = True, max_model_len: int = 4096,
                 max_num_seqs: int = 128, parallel: ParallelContext | None = None,
                 batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.parallel = parallel if parallel is not None and parallel.world_size > 1 else None
        self.num_kv_heads = model.layers[0].self_attn.num_kv_heads  # this rank's share under tensor parallelism
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.sampler = Sampler(seed)
        if device.type == "cpu":
            from splitserve.engine.kernels.cpu_linear import pack_linears

            pack_linears(model, min_rows=2 if batch_invariant else 1)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.graphs = None
        self._host_tokens: list[torch.Tensor] | None = None  # pinned landing buffers of launched steps' tokens
        self._flip = 0

    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.arch.num_layers * self.block_size * self.num_kv_heads * self.arch.head_dim * itemsize

    def init_kv_cache(self, num_blocks: int) -> None:
        # on CUDA one extra scratch block takes the (ignored) writes of padded CUDA-graph rows
        shape = (num_blocks + int(self.use_graphs), self.block_size, self.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.arch.num_layers)
        ]
        if self.use_graphs:
            from splitserve.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_caches, num_blocks, self.block_size,
                                       cdiv(self.max_model_len, self.block_size), self.max_num_seqs, self.device,
                                       self.batch_invariant)
            self.graphs.capture()

    def block_payload_shape(self) -> tuple[int, ...]:
        """One block of every layer's K and V: [layers, 2, block_size, kv_heads, head_dim]."""
        return (self.arch.num_layers, 2, self.block_size, self.num_kv_heads, self.arch.head_dim)

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copies of these blocks as a uint8 CPU tensor [n, bytes per block]: one gather per layer and K/V."""
        n = len(block_ids)
        out = torch.empty((n, *self.block_payload_shape()), dtype=self.dtype, device=self.device)
        if n:
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            for layer, (k, v) in enumerate(self.kv_caches):
                torch.index_select(k, 0, idx, out=out[:, layer, 0])
                torch.index_select(v, 0, idx, out=out[:, layer, 1])
        return out.view(n, -1).view(torch.uint8).cpu() if n else torch.empty((0, 0), dtype=torch.uint8)

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write `read_blocks`-shaped bytes into these blocks: one scatter per layer and K/V."""
        n = len(block_ids)
        if not n:
            return
        blocks = data.to(self.device).view(self.dtype).view(n, *self.block_payload_shape())
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, idx, blocks[:, layer, 0])
            v.index_copy_(0, idx, blocks[:, layer, 1])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, hooks: Sequence[KVLayerHook] = ()) -> dict[str, SampledToken]:
        # Decodes (one new token) first, so their attention runs as one batched kernel.
        order = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        layered = [h for h in hooks if h.on_step_begin(order)]  # hooks that want this step layer by layer
        batch = self.build(order, graphs_ok=not layered)
        if self.parallel is not None:
            for h in layered:  # under tensor parallelism a layered hook plans the other ranks' part too
                batch.rank_plan += h.rank_plan()
            send_step(self.parallel, batch)
        logits = self.forward(batch, _fan_out(layered) if layered else None)
        for h in hooks:
            h.on_step_end(order)
        sampling = [s.request for s in order if s.sample]
        if not sampling:
            return {}
        tokens = self.sampler.sample(logits, sampling)
        return {r.request_id: t for r, t in zip(sampling, tokens, strict=True)}

    @torch.inference_mode()
    def launch(self, order: list[ScheduledRequest], prev: InFlight | None = None) -> InFlight:
        """Launch a step of greedy single-token decodes and return at once, its tokens left on the device (and on
        their way to the host). A row whose input is still a PENDING_TOKEN takes `prev`'s token for its request
        on the device, so this step runs right behind `prev` with no host round trip between them."""
        batch = self.build(order)
        feed = None
        if PENDING_TOKEN in batch.input_ids:
            where = {s.request_id: i for i, s in enumerate(prev.scheduled)} if prev is not None else {}
            rows = [i for i, t in enumerate(batch.input_ids) if t == PENDING_TOKEN]
            missing = [order[i].request_id for i in rows if order[i].request_id not in where]
            if missing:
                raise RuntimeError(f"no step in flight holds the input token of {missing[:3]}")
            feed = Feed(rows, [where[order[i].request_id] for i in rows], prev.tokens)
        logits = self.forward(batch, feed=feed)
        tokens = torch.argmax(logits, dim=-1)
        n = len(order)
        if self.device.type == "cuda":
            if self._host_tokens is None or len(self._host_tokens[0]) < n:
                self._host_tokens = [torch.empty(max(n, self.max_num_seqs), dtype=torch.long, pin_memory=True)
                                     for _ in range(2)]
            self._flip ^= 1  # two buffers: the step launched before this one may still be unread
            host = self._host_tokens[self._flip][:n]
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = tokens, None
        return InFlight(list(order), tokens, host, done)

    def build(self, order: list[ScheduledRequest], graphs_ok: bool = True) -> StepBatch:
        bs = self.block_size
        batch = StepBatch([], [], [])
        for s in order:
            n, start = s.num_new_tokens, s.start
            token_start = len(batch.input_ids)
            batch.input_ids += s.request.token_slice(start, start + n)
            table = s.block_ids
            if n == 1:
                batch.positions.append(start)
                batch.slot_mapping.append(table[start // bs] * bs + start % bs)
                batch.decode_block_tables.append(table[:start // bs + 1])
                batch.decode_seq_lens.append(start + 1)
            else:
                batch.positions += range(start, start + n)
                batch.slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
                batch.prefills.append(PrefillChunk(token_start, n, start, table[:cdiv(start + n, bs)]))
            if s.sample:
                batch.sample_idx.append(token_start + n - 1)
        batch.use_graph = (graphs_ok and self.graphs is not None and not batch.prefills
                           and batch.num_decodes <= self.graphs.max_batch)
        return batch

    def forward(self, batch: StepBatch, on_layer_written=None, feed: Feed | None = None) -> torch.Tensor | None:
        """Run one step; logits [num_samples, vocab] float32 (None when nothing is sampled)."""
        if batch.use_graph:
            logits = self.graphs.run(batch, feed)  # [num_decodes, vocab] float32
            if len(batch.sample_idx) == batch.num_decodes:  # every row (rows are in order): no gather
                return logits
            return logits[batch.sample_idx] if batch.sample_idx else None
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long).to(dev),
                                 block_size=self.block_size, num_decodes=batch.num_decodes,
                                 prefills=[PrefillSeq(p.token_start, p.num_tokens, p.context_start,
                                                      torch.tensor(p.block_ids, dtype=torch.long).to(dev))
                                           for p in batch.prefills],
                                 on_layer_written=on_layer_written, batch_invariant=self.batch_invariant,
                                 max_seq_len=self.max_model_len)
        if batch.num_decodes:
            tables = batch.decode_block_tables
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long).to(dev)
            meta.decode_seq_lens = torch.tensor(batch.decode_seq_lens, dtype=torch.long).to(dev)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long).to(dev)
        if feed is not None:
            feed.apply(input_ids)
        positions = torch.tensor(batch.positions, dtype=torch.long).to(dev)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not batch.sample_idx:
            return None
        sample_idx = torch.tensor(batch.sample_idx, dtype=torch.long).to(dev)
        return self.model.compute_logits(hidden[sample_idx])


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not been read: `tokens` on the device, `host` their copy, valid
    once `done` (a CUDA event; None on CPU, where the step has already run) has completed."""

    scheduled: list[ScheduledRequest]
    tokens: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None

    def token_ids(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def _fan_out(hooks: list[KVLayerHook]):
    if len(hooks) == 1:
        return hooks[0].on_layer_written

    def on_layer_written(layer_idx: int) -> None:
        for h in hooks:
            h.on_layer_written(layer_idx)

    return on_layer_written
