"""Test helpers: build engines and Hugging Face greedy references."""

from __future__ import annotations

from pathlib import Path

import torch

from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from splitserve.engine.llm_engine import LLMEngine


def make_engine(model_dir: Path | str, *, budget: int = 2048, chunked: bool = True, kv_memory="64MiB",
                block_size: int = 16, max_model_len: int | None = 1024, prefix_caching: bool = True,
                max_num_seqs: int = 64, dtype: str = "float32", device: str = "cpu") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), dtype=dtype, device=device, max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_memory, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                                  max_num_seqs=max_num_seqs),
    ))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


_HF_CACHE: dict = {}


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    """Hugging Face transformers' greedy continuation of each prompt (unbatched, float32, CPU)."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = _HF_CACHE[key]
    outs = []
    for p in prompts:
        kw = {"min_new_tokens": max_tokens} if ignore_eos else {}
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kw)
        outs.append(out[0, len(p):].tolist())
    return outs
