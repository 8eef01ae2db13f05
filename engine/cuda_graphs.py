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
                 max_batch: int, device: torch.device, batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
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
        # pinned host staging for those inputs, two sets taken in turn: a copy from pageable memory may wait for
        # the stream, which would stall an overlapped step's launch behind the step in flight; a set is reused
        # two steps later, when the step that read it has finished (its tokens were read before this launch)
        self._staging = [(torch.empty(4 * n, dtype=torch.long, pin_memory=True),
                          torch.empty(n * max_blocks, dtype=torch.long, pin_memory=True),
                          torch.empty(2 * n, dtype=torch.long, pin_memory=True)) for _ in range(2)]
        self._turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slots[:b], block_size=self.block_size, num_decodes=b,
                                 decode_block_tables=self.tables[:b], decode_seq_lens=self.lens[:b],
                                 batch_invariant=self.batch_invariant, max_seq_len=self.tables.shape[1] * self.block_size)
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
        self._turn ^= 1
        header_in, tables_in, feed_in = self._staging[self._turn]
        # ids, positions, slots and lengths of the bucket's rows in one copy; padded rows write to the
        # scratch slot and attend over one token (their block-table rows may be stale: they are never used)
        header = header_in[: 4 * b].view(4, b)
        rows = header.numpy()
        rows[0, :n], rows[1, :n], rows[2, :n], rows[3, :n] = (batch.input_ids, batch.positions, batch.slot_mapping,
                                                              batch.decode_seq_lens)
        rows[:, n:] = np.array([[0], [0], [self.scratch * self.block_size], [1]])
        self.header.view(4, -1)[:, :b].copy_(header, non_blocking=True)
        tables = batch.decode_block_tables
        width = max(len(t) for t in tables)
        padded = tables_in[: n * width].view(n, width)
        table_rows = padded.numpy()
        table_rows.fill(self.scratch)
        for i, t in enumerate(tables):  # row-wise numpy fill: 2x a nested torch.tensor
            table_rows[i, :len(t)] = t
        self.tables[:n, :width].copy_(padded, non_blocking=True)
        if feed is not None:
            feed.apply(self.input_ids, feed_in)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]
