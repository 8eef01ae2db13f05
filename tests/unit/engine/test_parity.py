"""Greedy generation must match Hugging Face transformers token for token (float32, CPU).

Real SmolLM2 weights, and small random-weight Qwen3 (q/k norm), Qwen3-MoE, Mixtral, Llama-3 (rope scaling,
tied embeddings) and Qwen2 (qkv bias) models saved by transformers; batches of mixed-length prompts with
chunked prefill on and off, prefix-cache hits and preemption forced by a tiny KV budget.
"""

from __future__ import annotations

import random

import pytest
from support.helpers import greedy, hf_greedy, make_engine

MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "hi",
    "Write a haiku about autumn leaves falling on a quiet river at dusk.",
    "List three prime numbers.",
    "Explain, step by step and in plain words, why the sky looks blue during the day but red at sunset. "
    "Mention Rayleigh scattering, the length of the path light takes through the atmosphere, and what "
    "happens to the shorter wavelengths along the way. Keep it short.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def smol_prompts(smollm2_dir):
    from splitserve.common.text import Tokenizer

    tok = Tokenizer(smollm2_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def smol_reference(smollm2_dir, smol_prompts):
    return hf_greedy(smollm2_dir, smol_prompts, MAX_TOKENS)


def _ours(engine, prompts, max_tokens=MAX_TOKENS):
    return [r["token_ids"] for r in engine.generate(prompts, greedy(max_tokens))]


@pytest.mark.parametrize("mode", ["chunked", "chunked-small-budget", "no-chunking"])
def test_smollm2_matches_hf(smollm2_dir, smol_prompts, smol_reference, mode):
    budget = {"chunked": 2048, "chunked-small-budget": 40, "no-chunking": 256}[mode]
    engine = make_engine(smollm2_dir, budget=budget, chunked=mode != "no-chunking")
    assert max(len(p) for p in smol_prompts) > 40  # the small budget really splits prompts into chunks
    assert _ours(engine, smol_prompts) == smol_reference


def test_smollm2_prefix_cache_hits_match_hf(smollm2_dir, smol_prompts, smol_reference):
    engine = make_engine(smollm2_dir)
    _ours(engine, smol_prompts[:2])
    cached = []
    for i, p in enumerate(smol_prompts):
        engine.add_request(f"again-{i}", p, greedy(MAX_TOKENS))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                cached.append(o.num_cached_tokens)
    # every chat prompt shares the system prompt; the first two are cached whole
    assert sum(cached) > 0 and max(cached) >= 32
    assert [outs[f"again-{i}"] for i in range(len(smol_prompts))] == smol_reference


def test_smollm2_preemption_under_tiny_kv_budget(smollm2_dir, smol_prompts, smol_reference):
    per_block = 2 * 30 * 16 * 3 * 64 * 4  # bytes: K and V, 30 layers, 16 tokens, 3 KV heads, 64 dims, fp32
    longest = max(len(p) for p in smol_prompts) + MAX_TOKENS
    blocks = -(-longest // 16) + 2
    engine = make_engine(smollm2_dir, kv_memory=blocks * per_block, max_model_len=blocks * 16, prefix_caching=False)
    assert engine.kv_spec.num_blocks == blocks
    assert _ours(engine, smol_prompts) == smol_reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.pool.num_used_blocks == 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "mixtral", "llama3", "qwen2"])
def test_random_models_match_hf(random_models, kind):
    rng = random.Random(kind)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (5, 37, 1, 90, 16, 64)]
    ref = hf_greedy(random_models[kind], prompts, 16, ignore_eos=True)
    for budget, chunked in ((2048, True), (24, True), (128, False)):
        engine = make_engine(random_models[kind], budget=budget, chunked=chunked, block_size=8)
        ours = [r["token_ids"] for r in engine.generate(prompts, greedy(16, ignore_eos=True))]
        assert ours == ref, (kind, budget, chunked)
