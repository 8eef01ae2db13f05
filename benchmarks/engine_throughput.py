"""Offline throughput: splitserve's engine vs Hugging Face `generate` (batched) vs vLLM's CPU build.

Every system gets the same prompts and generates exactly `--output-len` tokens per prompt (EOS ignored).
Prints a table, then one JSON line: ours_tok_s, hf_tok_s, ratio_vs_hf, vllm_tok_s, ratio_vs_vllm.
vLLM runs in a separate interpreter (`--vllm-python` or $VLLM_PYTHON); null when it is not available.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from harness import finish

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the ocean at night.",
    "Explain how a refrigerator keeps food cold.",
    "Give me three tips for learning a new language quickly and remembering new words.",
    "Summarise the plot of a detective story set in a small seaside village in winter.",
    "Why do cats purr?",
    "Describe the water cycle for a ten year old, mentioning evaporation, condensation and rain.",
    "List five healthy breakfast ideas.",
    "How does a bicycle stay upright when it is moving forward at a steady speed?",
    "What are the main differences between a violin and a viola?",
    "Write a friendly email inviting colleagues to a team lunch on Friday.",
    "Tell me a fun fact about octopuses.",
    "What should I pack for a weekend hiking trip in the mountains in early autumn?",
    "Explain recursion with a simple example.",
    "Suggest a name for a bakery that specialises in sourdough bread.",
    "How do bees make honey?",
]

VLLM_SCRIPT = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=2048, seed=0, enforce_eager=False)
    sp = SamplingParams(max_tokens=cfg["output_len"], temperature=0.0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("VLLM_RESULT " + json.dumps({"seconds": dt, "tokens": n}))
if __name__ == "__main__":
    main()
"""


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            for i in range(n)]


def bench_ours(model_dir, prompts, output_len, dtype) -> tuple[float, int]:
    from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
    from splitserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), dtype=dtype, max_model_len=2048),
        cache=CacheConfig(kv_cache_memory="512MiB", enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=4096),
    ))
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    res = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return dt, sum(len(r["token_ids"]) for r in res)


def bench_hf(model_dir, prompts, output_len, dtype) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=pad)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t0
    return dt, (out.shape[1] - width) * len(prompts)


def bench_vllm(python, model_dir, prompts, output_len, dtype) -> tuple[float, int] | None:
    if not python or not os.path.exists(python):
        return None
    python = os.path.abspath(python)  # it runs from a temporary directory
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "run_vllm.py")
        cfg = os.path.join(tmp, "cfg.json")
        open(script, "w").write(VLLM_SCRIPT)
        json.dump({"model": str(model_dir), "prompts": prompts, "output_len": output_len, "dtype": dtype}, open(cfg, "w"))
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1")
        res = subprocess.run([python, script, cfg], capture_output=True, text=True, env=env, timeout=1800, cwd=tmp)
    for line in res.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            r = json.loads(line.split(" ", 1)[1])
            return r["seconds"], r["tokens"]
    print(f"vLLM run failed (rc={res.returncode}): {res.stderr.strip().splitlines()[-3:]}", file=sys.stderr)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", ""))
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    from splitserve.common.text import Tokenizer
    from splitserve.engine.model_files import prepare_model

    model_dir = prepare_model(args.model)
    prompts = make_prompts(Tokenizer(model_dir), args.num_prompts)
    rows = []
    ours = bench_ours(model_dir, prompts, args.output_len, args.dtype)
    rows.append(("splitserve", *ours))
    hf = None if args.skip_hf else bench_hf(model_dir, prompts, args.output_len, args.dtype)
    if hf:
        rows.append(("hf generate", *hf))
    vllm = bench_vllm(args.vllm_python, model_dir, prompts, args.output_len, args.dtype)
    if vllm:
        rows.append(("vllm cpu", *vllm))

    lines = [f"model={args.model} prompts={args.num_prompts} output_len={args.output_len} dtype={args.dtype} "
             f"threads={torch.get_num_threads()} prompt_tokens={sum(map(len, prompts))}",
             f"{'system':<14}{'seconds':>10}{'tokens':>10}{'tok/s':>10}"]
    lines += [f"{name:<14}{secs:>10.2f}{toks:>10}{toks / secs:>10.1f}" for name, secs, toks in rows]
    ours_tps = ours[1] / ours[0]
    hf_tps = hf[1] / hf[0] if hf else None
    vllm_tps = vllm[1] / vllm[0] if vllm else None
    finish("\n".join(lines), {
        "model": args.model, "num_prompts": args.num_prompts, "output_len": args.output_len, "dtype": args.dtype,
        "ours_tok_s": round(ours_tps, 2),
        "hf_tok_s": round(hf_tps, 2) if hf_tps else None,
        "ratio_vs_hf": round(ours_tps / hf_tps, 3) if hf_tps else None,
        "vllm_tok_s": round(vllm_tps, 2) if vllm_tps else None,
        "ratio_vs_vllm": round(ours_tps / vllm_tps, 3) if vllm_tps else None,
    })


if __name__ == "__main__":
    main()
