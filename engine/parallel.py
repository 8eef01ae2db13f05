"""Tensor and expert parallelism, applied from outside the model code (one process per GPU, NCCL).

`shard_model` takes the single-device model (built on the meta device) and shrinks its layers to this rank's
part; forward hooks add the collectives:
- attention: q heads and KV heads split over ranks (KV heads replicated when there are fewer than ranks),
  `qkv_proj` column-parallel, `o_proj` row-parallel + all-reduce;
- dense MLP: the intermediate dimension split (`gate_up_proj` column-, `down_proj` row-parallel + all-reduce);
- MoE: with tensor parallelism each expert's intermediate dimension is split; with expert parallelism whole
  experts are spread over ranks. Attention is tensor-parallel either way, so every rank holds every token after
  the attention all-reduce: a rank runs only the (token, expert) pairs whose expert it holds (the dispatch) and
  one all-reduce sums the partial outputs (the combine);
- LM head: vocabulary split and the logits all-gathered (replicated when tied to the embedding);
- the embedding and the norms are replicated.

Each sharded parameter records, per sharded dimension, which full-model index each local row came from
(`model.param_shards`), so the checkpoint loader slices full tensors straight into the shards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from splitserve.engine.models.arch import ArchConfig
from splitserve.engine.models.layers import GatedMLP
from splitserve.engine.models.llama import CausalLM
from splitserve.engine.models.moe import SparseMoE

log = logging.getLogger("splitserve.engine.parallel")

# all_gather_into_tensor was renamed all_gather_single; take whichever this torch has
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class ParallelContext:
    """This process's place in the tensor-parallel group and the groups it talks through."""

    rank: int
    world_size: int
    expert_parallel: bool = False
    group: dist.ProcessGroup | None = None  # tensors: NCCL on CUDA, gloo on CPU
    control: dist.ProcessGroup | None = None  # gloo: the step each rank runs, sent by rank 0
    closed: bool = field(default=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world_size * n], rank order."""
        rows = x.reshape(-1, x.shape[-1])
        parts = torch.empty((self.world_size * rows.shape[0], rows.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather(parts, rows.contiguous(), group=self.group)
        parts = parts.view(self.world_size, *rows.shape).permute(1, 0, 2)  # [rows, world, n]
        return parts.reshape(*x.shape[:-1], self.world_size * x.shape[-1])

    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def close(self) -> None:
        """Tear the groups down. NCCL's are aborted rather than destroyed: a destroy waits on the peers (and on
        CUDA graphs still holding the communicator), and a closing group has nothing left to finish."""
        if self.closed or not dist.is_initialized():
            return
        self.closed = True
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.get_backend(self.group) == "nccl":
            abort()
        else:
            dist.destroy_process_group()


def init_parallel(rank: int, world_size: int, init_method: str, device: torch.device,
                  expert_parallel: bool = False, timeout_s: float = 600.0) -> ParallelContext:
    from datetime import timedelta

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    log.info("rank %d/%d joined (%s)", rank, world_size, backend)
    return ParallelContext(rank, world_size, expert_parallel, dist.group.WORLD, control)


def check_shardable(arch: ArchConfig, world_size: int, expert_parallel: bool) -> None:
    """Raise ValueError, naming the field, if `arch` cannot be split over `world_size` ranks."""
    if world_size == 1:
        return
    ctx = ParallelContext(0, world_size, expert_parallel)
    _split(arch.num_heads, ctx, "num_attention_heads")
    _kv_heads(arch.num_kv_heads, ctx)
    if any(not arch.is_moe_layer(i) for i in range(arch.num_layers)):
        _split(arch.intermediate_size, ctx, "intermediate_size")
    if arch.is_moe:
        if expert_parallel:
            _split(arch.num_experts, ctx, "num_experts")
        else:
            _split(arch.moe_intermediate_size, ctx, "moe_intermediate_size")


# -- sharding ---------------------------------------------------------------------------------------------
def _split(n: int, ctx: ParallelContext, what: str) -> range:
    if n % ctx.world_size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={ctx.world_size}")
    per = n // ctx.world_size
    return range(ctx.rank * per, (ctx.rank + 1) * per)


def _kv_heads(num_kv_heads: int, ctx: ParallelContext) -> range:
    return kv_head_range(num_kv_heads, ctx.rank, ctx.world_size)


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> range:
    """KV heads rank `rank` of `world_size` holds (global head indices, a contiguous run): an equal split, or
    with fewer KV heads than ranks one head per rank, shared by world_size / num_kv_heads consecutive ranks.
    The KV cache shard layout every rank and every transfer ticket agrees on (`kv_transfer/ticket.py`)."""
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by tensor_parallel_size={world_size}")
        per = num_kv_heads // world_size
        return range(rank * per, (rank + 1) * per)
    if world_size % num_kv_heads:
        raise ValueError(f"num_key_value_heads={num_kv_heads} must divide tensor_parallel_size={world_size}")
    h = rank * num_kv_heads // world_size
    return range(h, h + 1)


@dataclass(frozen=True)
class KVShard:
    """Which KV heads this rank's cache holds: per layer K and V are [num_blocks, block_size, num_heads, head_dim]
    holding global heads head_start .. head_start + num_heads - 1 of num_kv_heads. Block ids are the same on
    every rank (rank 0 schedules for all)."""

    rank: int = 0
    world_size: int = 1
    head_start: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0  # the model's, over all ranks

    @classmethod
    def of(cls, num_kv_heads: int, rank: int, world_size: int) -> KVShard:
        heads = kv_head_range(num_kv_heads, rank, world_size)
        return cls(rank, world_size, heads.start, len(heads), num_kv_heads)

    @property
    def replicated(self) -> bool:
        """Several ranks hold each head (fewer KV heads than ranks)."""
        return self.num_kv_heads < self.world_size


def replicate_kv_heads(ctx: ParallelContext, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       block_ids: list[int], num_kv_heads: int) -> None:
    """With fewer KV heads than ranks, make every rank sharing a head hold that head's `block_ids` as its first
    holder has them (KV that arrived from outside lands on the first holder only). Every rank calls this for
    the same blocks at the same point in the step sequence; point-to-point sends, so no sub-groups."""
    if num_kv_heads >= ctx.world_size or not block_ids:
        return
    share = ctx.world_size // num_kv_heads  # ranks per head
    first = ctx.rank - ctx.rank % share
    k0 = kv_caches[0][0]
    idx = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
    # [layers, 2, n, block_size, 1, head_dim]: the blocks of this rank's one head, every layer's K and V
    buf = torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)]) for k, v in kv_caches])
    if ctx.rank == first:
        for r in range(first + 1, first + share):
            dist.send(buf, dst=r, group=ctx.group)
        return
    dist.recv(buf, src=first, group=ctx.group)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, idx, buf[layer, 0])
        v.index_copy_(0, idx, buf[layer, 1])


def _rows(units: range, unit: int, offset: int = 0) -> torch.Tensor:
    """Full-model row indices of `units` blocks of `unit` rows, starting at `offset`."""
    return torch.cat([torch.arange(offset + u * unit, offset + (u + 1) * unit) for u in units])


def _sharded_linear(linear: nn.Linear, dim: int, index: torch.Tensor) -> nn.Linear:
    """A meta-device nn.Linear holding the rows (dim 0) or columns (dim 1) `index` of `linear`."""
    out_f, in_f = linear.out_features, linear.in_features
    if dim == 0:
        out_f = len(index)
    else:
        in_f = len(index)
    with torch.device("meta"):
        return nn.Linear(in_f, out_f, bias=linear.bias is not None and dim == 0,
                         dtype=linear.weight.dtype)


def shard_model(model: CausalLM, ctx: ParallelContext) -> CausalLM:
    """Shrink `model` (on the meta device) to rank `ctx.rank`'s part, in place; returns it."""
    if ctx.world_size == 1:
        return model
    cfg = model.cfg
    shards: dict[str, dict[int, torch.Tensor]] = {}
    reduce = _hook(ctx.all_reduce)
    q_heads = _split(cfg.num_heads, ctx, "num_attention_heads")
    kv_heads = _kv_heads(cfg.num_kv_heads, ctx)
    d = cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    # the same rows in every layer: q heads, then K heads, then V heads of the fused qkv
    rows = torch.cat([_rows(q_heads, d), _rows(kv_heads, d, q_size), _rows(kv_heads, d, q_size + kv_size)])
    cols = _rows(q_heads, d)
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        attn = layer.self_attn
        attn.qkv_proj = _sharded_linear(attn.qkv_proj, 0, rows)
        shards[p + "self_attn.qkv_proj.weight"] = {0: rows}
        if attn.qkv_proj.bias is not None:
            shards[p + "self_attn.qkv_proj.bias"] = {0: rows}
        attn.o_proj = _sharded_linear(attn.o_proj, 1, cols)
        attn.o_proj.register_forward_hook(reduce)
        shards[p + "self_attn.o_proj.weight"] = {1: cols}
        attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
        attn.q_size, attn.kv_size = len(q_heads) * d, len(kv_heads) * d
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            part = torch.tensor(_split(mlp.intermediate, ctx, "intermediate_size"))
            gate_up = torch.cat([part, mlp.intermediate + part])
            mlp.gate_up_proj = _sharded_linear(mlp.gate_up_proj, 0, gate_up)
            mlp.down_proj = _sharded_linear(mlp.down_proj, 1, part)
            mlp.down_proj.register_forward_hook(reduce)
            shards[p + "mlp.gate_up_proj.weight"] = {0: gate_up}
            shards[p + "mlp.down_proj.weight"] = {1: part}
            mlp.intermediate = len(part)
        elif isinstance(mlp, SparseMoE):
            shards.update(_shard_moe(mlp, ctx, p + "mlp."))
            mlp.register_forward_hook(reduce)
    if not cfg.tie_word_embeddings and cfg.vocab_size % ctx.world_size == 0:
        vocab = torch.tensor(_split(cfg.vocab_size, ctx, "vocab_size"))
        model.lm_head = _sharded_linear(model.lm_head, 0, vocab)
        model.lm_head.register_forward_hook(_hook(ctx.all_gather_last))
        shards["lm_head.weight"] = {0: vocab}
    model.param_shards = shards
    log.info("rank %d: %d q heads, %d kv heads, expert_parallel=%s", ctx.rank, len(q_heads), len(kv_heads),
             ctx.expert_parallel)
    return model


def _shard_moe(mlp: SparseMoE, ctx: ParallelContext, prefix: str) -> dict[str, dict[int, torch.Tensor]]:
    e, two_i, h = mlp.w13.shape
    inter = two_i // 2
    if ctx.expert_parallel:
        experts = _split(e, ctx, "num_experts")
        index = torch.tensor(experts)
        mlp.w13 = nn.Parameter(torch.empty(len(index), two_i, h, device="meta", dtype=mlp.w13.dtype))
        mlp.w2 = nn.Parameter(torch.empty(len(index), h, inter, device="meta", dtype=mlp.w2.dtype))
        mlp.expert_start = experts.start
        return {prefix + "w13": {0: index}, prefix + "w2": {0: index}}
    part = torch.tensor(_split(inter, ctx, "moe_intermediate_size"))
    gate_up = torch.cat([part, inter + part])
    mlp.w13 = nn.Parameter(torch.empty(e, len(gate_up), h, device="meta", dtype=mlp.w13.dtype))
    mlp.w2 = nn.Parameter(torch.empty(e, h, len(part), device="meta", dtype=mlp.w2.dtype))
    mlp.intermediate = len(part)
    return {prefix + "w13": {1: gate_up}, prefix + "w2": {2: part}}


def _hook(collective):
    def hook(_module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return collective(output)

    return hook


# -- loading full checkpoint tensors into shards ------------------------------------------------------------
def load_into(param: torch.Tensor, index, tensor: torch.Tensor, shard: dict[int, torch.Tensor] | None) -> None:
    """param[index] = tensor, with `index` (None, int, slice or a tuple of them) in full-model coordinates.

    `shard` maps each sharded dimension of `param` to the full index of every local row; the rows of `tensor`
    that belong to other ranks are skipped.
    """
    if not shard:
        (param if index is None else param[index]).copy_(tensor)
        return
    full_ix = () if index is None else (index if isinstance(index, tuple) else (index,))
    full_ix = full_ix + (slice(None),) * (param.dim() - len(full_ix))
    dst, src = param, tensor
    # ints first, from the last dim down, so earlier dims keep their numbers
    for d in reversed(range(param.dim())):
        ix = full_ix[d]
        if isinstance(ix, int):
            local = ix if d not in shard else _local_of(shard[d], ix)
            if local is None:
                return  # that row lives on another rank
            dst = dst.select(d, local)
    kept = [d for d in range(param.dim()) if not isinstance(full_ix[d], int)]
    sharded = [(out_d, d) for out_d, d in enumerate(kept) if d in shard]
    for out_d, d in enumerate(kept):
        if d not in shard:
            start, stop, _ = full_ix[d].indices(param.shape[d])
            dst = dst.narrow(out_d, start, stop - start)
    if not sharded:
        dst.copy_(src)
        return
    if len(sharded) > 1:
        raise ValueError("a parameter can be sharded along one sliced dimension only")
    out_d, d = sharded[0]
    ix = full_ix[d]
    if ix.step not in (None, 1):
        raise ValueError("strided checkpoint slices are not supported")
    start = ix.start or 0
    stop = start + src.shape[out_d]
    rows = shard[d]
    mine = ((rows >= start) & (rows < stop)).nonzero().flatten()
    if len(mine):
        picked = src.index_select(out_d, (rows[mine] - start).to(src.device))
        dst.index_copy_(out_d, mine.to(dst.device), picked.to(dst.dtype))


def _local_of(rows: torch.Tensor, full: int) -> int | None:
    hit = (rows == full).nonzero()
    return int(hit[0, 0]) if len(hit) else None
