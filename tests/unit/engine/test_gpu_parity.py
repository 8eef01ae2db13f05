"""Greedy parity with Hugging Face transformers on a CUDA GPU in bfloat16.

bf16 rounding makes near-ties flip, so tokens are compared where the reference's top-2 logit margin is
clear: Hugging Face scores our generated sequence (teacher forcing) and at every position with a clear
margin our token must be its argmax; the chosen token's log-probability must agree closely everywhere.
The random models use Hugging Face's init scale (std 0.02) so bf16 noise is not amplified layer by layer.
Skipped where no GPU exists (CI covers the CPU path).
"""

from __future__ import annotations

import random

import pytest
import torch
from support.helpers import greedy, make_engine
from support.models import make_random_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CLEAR_MARGIN = 0.5  # logits
INIT = dict(std=0.02, head_std=0.5)  # Hugging Face's init scale; a peakier output head


def _smollm2_shaped(path):
    from support.models import _save_random
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    return _save_random(cfg, path, **INIT)


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_models")
    models = {k: make_random_model(k, root / k, **INIT) for k in ("qwen3", "qwen3_moe", "mixtral", "llama3")}
    models["smollm2_shaped"] = _smollm2_shaped(root / "smollm2_shaped")
    return models


def check_against_hf(model_dir, prompts, ours, ours_lp, device="cuda"):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    compared = clear = 0
    rel_errs = []
    for p, toks, lps in zip(prompts, ours, ours_lp, strict=True):
        ids = torch.tensor([p + toks], device=device)
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
        for i, tok in enumerate(toks):
            row = logits[len(p) - 1 + i]
            top2 = torch.topk(row, 2)
            margin = (top2.values[0] - top2.values[1]).item()
            ref_lp = torch.log_softmax(row, -1)[tok].item()
            rel_errs.append(abs(lps[i].logprob - ref_lp) / max(1.0, abs(ref_lp)))
            compared += 1
            if margin > CLEAR_MARGIN:
                clear += 1
                assert tok == top2.indices[0].item(), (i, margin)
    # enough evidence to judge: a third of the positions (a 32k-vocabulary random head has closer runner-ups)
    assert clear >= compared // 3, f"too few clear positions ({clear}/{compared}) to judge parity"
    assert max(rel_errs) < 0.1, max(rel_errs)
    return clear, compared


@pytest.mark.parametrize("kind", ["smollm2_shaped", "qwen3", "qwen3_moe", "mixtral", "llama3"])
@pytest.mark.parametrize("budget", [2048, 32])
def test_gpu_bf16_parity(gpu_models, kind, budget):
    vocab = 49152 if kind == "smollm2_shaped" else 384
    rng = random.Random(kind)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 37, 1, 90, 16, 64)]
    engine = make_engine(gpu_models[kind], budget=budget, dtype="bfloat16", device="cuda", block_size=16)
    res = engine.generate(prompts, greedy(16, ignore_eos=True, logprobs=1))
    assert engine.device.type == "cuda"
    clear, compared = check_against_hf(gpu_models[kind], prompts, [r["token_ids"] for r in res],
                                       [r["logprobs"] for r in res])
    print(f"{kind} budget={budget}: {clear}/{compared} clear positions matched")


def test_gpu_prefix_cache_and_preemption(gpu_models):
    path = gpu_models["qwen3"]
    rng = random.Random(7)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (40, 70, 33, 90)]
    big = make_engine(path, dtype="bfloat16", device="cuda")
    ref = [r["token_ids"] for r in big.generate(prompts, greedy(16, ignore_eos=True))]
    again = [r["token_ids"] for r in big.generate(prompts, greedy(16, ignore_eos=True))]  # prefix hits
    assert again == ref
    per_block = 2 * 3 * 16 * 2 * 16 * 2  # K+V, 3 layers, 16 tokens, 2 KV heads, 16 dims, bf16 bytes
    tiny = make_engine(path, dtype="bfloat16", device="cuda", kv_memory=12 * per_block, max_model_len=192,
                       prefix_caching=False)
    out = [r["token_ids"] for r in tiny.generate(prompts, greedy(16, ignore_eos=True))]
    assert tiny.scheduler.num_preemptions > 0
    assert out == ref


def _save_random_bf16(cfg, path):
    """Random bf16 weights built on the GPU (HF init scale), saved for both engines to load. The output head's
    scale gives logits of std ~4: at std ~30 bf16's own rounding of a logit (0.25-0.5)
    would exceed the margin the comparison calls clear."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                head_std = 4.0 / cfg.hidden_size**0.5
                p.normal_(0.0, 1.0 if "embed" in name else head_std if "lm_head" in name else INIT["std"])
    model.save_pretrained(str(path))
    del model
    torch.cuda.empty_cache()
    return path


def _qwen3_moe_30b_shaped(path):
    """Qwen3-30B-A3B's real layer config (128 experts, top-8), cut to 2 layers and a 32k vocabulary."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False,
                         decoder_sparse_step=1, mlp_only_layers=[])
    return _save_random_bf16(cfg, path)


def _llama31_8b_shaped(path):
    """Llama-3.1-8B's real layer config, cut to 4 layers and a 32k vocabulary (random weights)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return _save_random_bf16(cfg, path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind,tp,ep", [("llama8b", 2, False), ("moe30b", 2, False), ("moe30b", 2, True),
                                        ("qwen3_moe", 2, True)])
def test_gpu_tensor_and_expert_parallel_parity(tmp_path_factory, gpu_models, kind, tp, ep):
    """TP=1, and TP=2 / EP=2 over NCCL, each pass the same check against Hugging Face."""
    from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.engine.config import ParallelConfig
    from splitserve.engine.llm_engine import LLMEngine

    root = tmp_path_factory.mktemp(kind)
    path = {"llama8b": _llama31_8b_shaped, "moe30b": _qwen3_moe_30b_shaped}.get(kind, lambda p: gpu_models[kind])(
        root / kind)
    vocab = 384 if kind == "qwen3_moe" else 32768
    rng = random.Random(kind)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 37, 1, 90, 16, 200)]

    def run(tp_size, expert_parallel):
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(str(path), dtype="bfloat16", device="cuda", max_model_len=1024),
            cache=CacheConfig(kv_cache_memory="2GiB"), scheduler=SchedulerConfig(max_num_batched_tokens=64),
            parallel=ParallelConfig(tp_size, expert_parallel)))
        try:
            return engine.generate(prompts, greedy(12, ignore_eos=True, logprobs=1))
        finally:
            engine.close()

    for size, expert_parallel in ((1, False), (tp, ep)):
        res = run(size, expert_parallel)
        clear, compared = check_against_hf(path, prompts, [r["token_ids"] for r in res], [r["logprobs"] for r in res])
        print(f"{kind} tp={size} ep={expert_parallel}: {clear}/{compared} clear positions matched")


def test_gpu_overlapped_decode_matches_serial(gpu_models):
    """The overlapped decode step (on by default on CUDA, with CUDA graphs) gives the tokens of serial steps."""
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (5, 37, 1, 90, 16, 64, 12, 8)]
    params = [greedy(n, ignore_eos=True) for n in (3, 17, 30, 1, 25, 9, 40, 2)]
    engine = make_engine(gpu_models["llama3"], dtype="bfloat16", device="cuda", block_size=16, prefix_caching=False)
    assert engine.overlap and engine.runner.graphs is not None
    launches = 0
    launch = engine.runner.launch

    def counted(order, prev=None):
        nonlocal launches
        launches += 1
        return launch(order, prev)

    engine.runner.launch = counted
    on = [r["token_ids"] for r in engine.generate(prompts, params)]
    engine.overlap = False
    off = [r["token_ids"] for r in engine.generate(prompts, params)]
    assert launches > 20
    assert on == off
    assert [len(t) for t in on] == [p.max_tokens for p in params]
    assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks
