"""The architecture description our models are built from, parsed from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DENSE_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
MOE_ARCHITECTURES = {"MixtralForCausalLM", "Qwen3MoeForCausalLM"}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = field(default=())

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        if not self.is_moe or layer_idx in self.mlp_only_layers:
            return False
        return (layer_idx + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "")]
        arch = archs[0]
        if arch not in DENSE_ARCHITECTURES | MOE_ARCHITECTURES:
            supported = ", ".join(sorted(DENSE_ARCHITECTURES | MOE_ARCHITECTURES))
            raise ValueError(f"unsupported architecture {arch!r}; supported: {supported}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"unsupported rope scaling type {kind!r} (supported: llama3)")
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        num_experts = 0
        if arch in MOE_ARCHITECTURES:
            num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=is_qwen3,
            num_experts=num_experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0),
            # Mixtral always renormalises its top-k weights; Qwen3-MoE follows norm_topk_prob.
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if is_qwen3 else True,
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            eos_token_ids=eos_ids,
        )
