"""One forward pass as plain integers: built by the model runner from the scheduler's output, and what rank 0
sends every other tensor-parallel rank so all of them run the same step (`send_step` / `receive_step`).

The wire form is one int64 tensor (no pickle): a fixed header, then the lists back to back. A step may carry a
`rank_plan`: what the ranks' KV connectors do during it (which requests' blocks to stream, layer by layer),
made on rank 0 by the layer hook that schedules transfers and read by each follower's connector. Between
steps rank 0 may also send a `KVCopy`: ranks sharing a KV head copy imported blocks from its first holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from splitserve.engine.parallel import ParallelContext

WIRE_VERSION = 2
_HEADER = 9  # version, use_graph, num_tokens, num_decodes, num_prefills, num_samples, table_width, plan length,
# payload length


@dataclass
class PrefillChunk:
    token_start: int  # index of the chunk's first token in the packed batch
    num_tokens: int
    context_start: int  # tokens of this sequence already in the cache
    block_ids: list[int]  # blocks covering context_start + num_tokens


@dataclass
class Feed:
    """Input tokens that are still on the device: row `rows[i]` of a step takes `tokens[src[i]]`, the token an
    earlier step sampled (the overlapped decode step launches before that step's tokens reach the host)."""

    rows: list[int]
    src: list[int]
    tokens: torch.Tensor  # [m] int64 on the device

    def apply(self, input_ids: torch.Tensor, staging: torch.Tensor | None = None) -> None:
        """Write the fed tokens into `input_ids` (on its device); `staging`: a pinned host buffer of at least
        2 * len(rows) for the indices, so their copy never waits for the stream."""
        m = len(self.rows)
        if staging is None:
            idx = torch.tensor([self.rows, self.src], dtype=torch.long)
        else:
            idx = staging[: 2 * m].view(2, m)
            idx.numpy()[:] = (self.rows, self.src)
        idx = idx.to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, idx[0], self.tokens.index_select(0, idx[1]))


@dataclass
class StepBatch:
    """Decodes (one token each) come first, then prefill chunks."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    decode_block_tables: list[list[int]] = field(default_factory=list)  # one per decode, trimmed to its length
    decode_seq_lens: list[int] = field(default_factory=list)  # including the new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    sample_idx: list[int] = field(default_factory=list)  # rows whose logits are sampled
    use_graph: bool = False
    rank_plan: list[int] = field(default_factory=list)  # for the followers' KV connectors (opaque here)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_seq_lens)

    def encode(self) -> torch.Tensor:
        width = max((len(t) for t in self.decode_block_tables), default=0)
        flat: list[int] = [WIRE_VERSION, int(self.use_graph), len(self.input_ids), self.num_decodes,
                           len(self.prefills), len(self.sample_idx), width, len(self.rank_plan), 0]
        flat += self.input_ids
        flat += self.positions
        flat += self.slot_mapping
        for t in self.decode_block_tables:
            flat += t
            flat += [-1] * (width - len(t))
        flat += self.decode_seq_lens
        for p in self.prefills:
            flat += (p.token_start, p.num_tokens, p.context_start, len(p.block_ids))
            flat += p.block_ids
        flat += self.sample_idx
        flat += self.rank_plan
        flat[8] = len(flat) - _HEADER
        return torch.tensor(flat, dtype=torch.long)

    @classmethod
    def decode(cls, wire: torch.Tensor, num_blocks: int) -> StepBatch:
        """Parse and check a step from rank 0; raises ValueError on anything inconsistent."""
        v = wire.tolist()
        if len(v) < _HEADER or v[0] != WIRE_VERSION:
            raise ValueError("step batch: bad header or version")
        _, graph, t, nd, npf, ns, width, nplan, length = v[:_HEADER]
        if length != len(v) - _HEADER or min(t, nd, npf, ns, width, nplan) < 0 or nd > t:
            raise ValueError("step batch: sizes do not match the payload")
        pos = _HEADER

        def take(n: int) -> list[int]:
            nonlocal pos
            if pos + n > len(v):
                raise ValueError("step batch: truncated")
            out = v[pos:pos + n]
            pos += n
            return out

        ids, positions, slots = take(t), take(t), take(t)
        tables = []
        for _ in range(nd):
            row = take(width)
            tables.append(row[:row.index(-1)] if -1 in row else row)
        lens = take(nd)
        prefills = []
        for _ in range(npf):
            start, n, ctx, nb = take(4)
            prefills.append(PrefillChunk(start, n, ctx, take(nb)))
        sample = take(ns)
        plan = take(nplan)
        if pos != len(v):
            raise ValueError("step batch: trailing data")
        blocks = [b for row in tables for b in row] + [b for p in prefills for b in p.block_ids]
        if any(not 0 <= b <= num_blocks for b in blocks) or any(not 0 <= s < t for s in sample):
            raise ValueError("step batch: block id or sample row out of range")
        return cls(ids, positions, slots, tables, lens, prefills, sample, bool(graph), plan)


@dataclass
class KVCopy:
    """Between steps: ranks that share a KV head copy these blocks from the head's first holder."""

    block_ids: list[int]


_STOP, _STEP, _KV_COPY = 0, 1, 2
_MAX_WIRE = 1 << 26  # int64s in one step message


def _send(ctx: ParallelContext, kind: int, wire: torch.Tensor) -> None:
    dist.broadcast(torch.tensor([kind, wire.numel()], dtype=torch.long), src=0, group=ctx.control)
    dist.broadcast(wire, src=0, group=ctx.control)


def send_step(ctx: ParallelContext, batch: StepBatch) -> None:
    _send(ctx, _STEP, batch.encode())


def send_kv_copy(ctx: ParallelContext, block_ids: list[int]) -> None:
    _send(ctx, _KV_COPY, torch.tensor(block_ids, dtype=torch.long))


def send_stop(ctx: ParallelContext) -> None:
    dist.broadcast(torch.tensor([_STOP, 0], dtype=torch.long), src=0, group=ctx.control)


def receive_step(ctx: ParallelContext, num_blocks: int) -> StepBatch | KVCopy | None:
    """The next message from rank 0: a step, a KV copy, or None when told to stop."""
    head = torch.empty(2, dtype=torch.long)
    dist.broadcast(head, src=0, group=ctx.control)
    kind, n = head.tolist()
    if kind == _STOP:
        return None
    if kind not in (_STEP, _KV_COPY) or not 0 < n <= _MAX_WIRE:
        raise ValueError(f"bad step message header {kind}, {n}")
    wire = torch.empty(n, dtype=torch.long)
    dist.broadcast(wire, src=0, group=ctx.control)
    if kind == _KV_COPY:
        blocks = wire.tolist()
        if any(not 0 <= b < num_blocks for b in blocks):
            raise ValueError("kv copy: block id out of range")
        return KVCopy(blocks)
    return StepBatch.decode(wire, num_blocks)
