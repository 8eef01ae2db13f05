"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once, replayed with inputs copied
into static buffers, so a decode step costs a few copies and one launch instead of thousands.

Padded rows of a bucket write their (ignored) K/V into a scratch block that the block pool never hands out.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.models.llama import CausalLM
from splitserve.engine.step_batch import Feed, StepBatch

log = logging.getLogger("splitserve.engine.cuda_graphs")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches, scratch_block: int, block_size: int, max_blocks: int,
                 max_batch: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch = scratch_block
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        n = self.buckets[-1]
        # static inputs: one buffer holding ids, positions, slots and lengths, each [n]
        self.header = torch.zeros(4 * n, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slots, self.lens = self.header.view(4, n).unbind(0)
        self.slots.fill_(scratch_block * block_size)
        self.lens.fill_(1)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slots[:b], block_size=self.block_size, num_decodes=b,
                                 decode_block_tables=self.tables[:b], decode_seq_lens=self.lens[:b])
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in self.buckets:  # warm-up: compile kernels, settle the allocator
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(b)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(self, batch: StepBatch, feed: Feed | None = None) -> torch.Tensor:
        """Logits [n, vocab] for a batch of n single-token decodes; `feed` puts tokens already on the device into
        some rows' inputs (the overlapped step)."""
        n = batch.num_decodes
        b = next(x for x in self.buckets if x >= n)
        pad = b - n
        # ids, positions, slots and lengths of the bucket's rows in one copy; padded rows write to the
        # scratch slot and attend over one token (their block-table rows may be stale: they are never used)
        header = torch.tensor([*batch.input_ids, *([0] * pad), *batch.positions, *([0] * pad),
                               *batch.slot_mapping, *([self.scratch * self.block_size] * pad),
                               *batch.decode_seq_lens, *([1] * pad)], dtype=torch.long)
        self.header.view(4, -1)[:, :b].copy_(header.view(4, b), non_blocking=True)
        tables = batch.decode_block_tables
        width = max(len(t) for t in tables)
        padded = np.full((n, width), self.scratch, dtype=np.int64)  # row-wise numpy fill: 2x a nested torch.tensor
        for i, t in enumerate(tables):
            padded[i, :len(t)] = t
        self.tables[:n, :width].copy_(torch.from_numpy(padded), non_blocking=True)
        if feed is not None:
            feed.apply(self.input_ids)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]
