"""Build a model from a Hugging Face directory (config.json + *.safetensors) straight onto its device."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.models.arch import ArchConfig
from splitserve.engine.models.llama import CausalLM
from splitserve.engine.parallel import ParallelContext, load_into, shard_model

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def load_arch(model_dir: str | Path) -> ArchConfig:
    with open(Path(model_dir) / "config.json") as f:
        return ArchConfig.from_hf(json.load(f))


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype, max_position: int,
               dummy: bool = False, parallel: ParallelContext | None = None) -> CausalLM:
    """`dummy`: random weights (N(0, 0.02), norms at 1) instead of the checkpoint, for benchmarks.

    With `parallel`, only this rank's shard is built and loaded (see splitserve.engine.parallel).
    """
    arch = load_arch(model_dir)
    with torch.device("meta"):
        model = CausalLM(arch, max_position)
    if parallel is not None:
        shard_model(model, parallel)
    # the dtype is set on the meta model, so the device holds only the final weights: allocating float32 and
    # converting after left the float32 copy (twice the model) in the caching allocator's reserve
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary.build_tables(device)  # float32 tables, computed on the device
    if dummy:
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    else:
        _load_weights(model, arch, Path(model_dir), device, dtype)
    model.eval()
    return model


def _load_weights(model: CausalLM, arch: ArchConfig, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    params = dict(model.named_parameters())
    shards = getattr(model, "param_shards", {})
    loaded: set[str] = set()
    dev = str(device)
    for path in files:
        with safe_open(str(path), framework="pt", device=dev) as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                for target, index in _map_name(name, arch):
                    if target not in params:
                        raise KeyError(f"{path.name}: weight {name} maps to unknown parameter {target}")
                    param = params[target]
                    with torch.no_grad():
                        load_into(param, index, tensor.to(dtype), shards.get(target))
                    loaded.add(target)
    _check_complete(model, loaded)


def _map_name(name: str, arch: ArchConfig) -> list[tuple[str, object]]:
    """Our parameter (and the slice of it) for a checkpoint tensor name."""
    if name == "lm_head.weight":
        return [] if arch.tie_word_embeddings else [("lm_head.weight", None)]
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return [(name.removeprefix("model."), None)]
    m = _LAYER.match(name)
    if not m:
        if name.endswith("rotary_emb.inv_freq"):
            return []
        raise KeyError(f"unexpected weight {name}")
    i, rest = int(m.group(1)), m.group(2)
    p = f"layers.{i}."
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    qkv_slices = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    parts = rest.split(".")
    if parts[0] == "self_attn" and parts[1] in qkv_slices:
        return [(f"{p}self_attn.qkv_proj.{parts[2]}", qkv_slices[parts[1]])]
    if rest in ("self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight"):
        return [(p + rest, None)]
    inter = arch.intermediate_size
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        sl = slice(0, inter) if "gate" in rest else slice(inter, 2 * inter)
        return [(f"{p}mlp.gate_up_proj.weight", sl)]
    if rest == "mlp.down_proj.weight":
        return [(p + rest, None)]
    if rest in ("block_sparse_moe.gate.weight", "mlp.gate.weight"):
        return [(f"{p}mlp.gate.weight", None)]
    e = _EXPERT.match(rest)
    if e:
        j, w = int(e.group(1)), e.group(2)
        mi = arch.moe_intermediate_size
        if w in ("w1", "gate_proj"):
            return [(f"{p}mlp.w13", (j, slice(0, mi)))]
        if w in ("w3", "up_proj"):
            return [(f"{p}mlp.w13", (j, slice(mi, 2 * mi)))]
        return [(f"{p}mlp.w2", j)]
    if rest == "mlp.experts.gate_up_proj":
        return [(f"{p}mlp.w13", None)]
    if rest == "mlp.experts.down_proj":
        return [(f"{p}mlp.w2", None)]
    raise KeyError(f"unexpected weight {name}")


def _check_complete(model: CausalLM, loaded: set[str]) -> None:
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    if missing:
        raise KeyError(f"checkpoint has no weights for {len(missing)} parameters, e.g. {missing[0]}")
