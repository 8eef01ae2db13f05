"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) and its sparse-MoE variants.

Single-device code over a packed batch of tokens: `[num_tokens, hidden]` in, no padding. Tensor and expert
parallelism are applied from outside by sharding these modules.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.attention import AttentionMetadata, paged_attention, write_kv
from splitserve.engine.models.arch import ArchConfig
from splitserve.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from splitserve.engine.models.moe import SparseMoE


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, k, cos_sin)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if meta.on_layer_written is not None:
            meta.on_layer_written(self.layer_idx)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = SparseMoE(
                cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, cos_sin, x, residual, kv_cache, meta: AttentionMetadata):
        """x: the previous layer's output, residual: the stream before it (None at layer 0); the adds are fused
        into the norms."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(cos_sin, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, max_position: int) -> None:
        super().__init__()
        self.cfg = cfg
        # built on the loader's meta device and filled from the checkpoint: an uninitialised weight skips the
        # random init, whose meta kernel alone imports torch's compiler (a second of every worker's start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (again after the module was moved)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(cos_sin, x, residual, kv, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        return self.lm_head(hidden).float()
