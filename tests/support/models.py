"""Small random-weight models saved by Hugging Face, for tests that need an architecture but not trained weights."""

from __future__ import annotations

from pathlib import Path


def _save_random(config, path: Path, seed: int = 0, std: float = 0.08, head_std: float | None = None) -> Path:
    """Random weights: N(0, std) matrices, N(0, 1) embeddings (peaky logits, so greedy has clear margins)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                if "embed" in name:
                    p.normal_(0.0, 1.0)
                elif "lm_head" in name and head_std is not None:
                    p.normal_(0.0, head_std)
                else:
                    p.normal_(0.0, std)
    model.save_pretrained(str(path))
    return path


TINY = dict(vocab_size=384, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def make_random_model(kind: str, path: Path, **init) -> Path:
    """Save a small random model of `kind` (qwen3, qwen3_moe, mixtral, llama3, qwen2) to `path`."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if kind == "qwen3":
        cfg = Qwen3Config(intermediate_size=128, head_dim=16, tie_word_embeddings=False, **TINY)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=True, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[1], **TINY)
    elif kind == "mixtral":
        cfg = MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **TINY)
    elif kind == "llama3":
        cfg = LlamaConfig(intermediate_size=128, tie_word_embeddings=True, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **TINY)
    elif kind == "qwen2":
        cfg = Qwen2Config(intermediate_size=128, tie_word_embeddings=False, **TINY)
    else:
        raise ValueError(kind)
    return _save_random(cfg, path, **init)
