"""What batch invariance (`engine.batchInvariant`) costs the native engine: prefill and decode tokens/s with the
setting off and on, on the CPU (SmolLM2) or a GPU (a Llama-3.1-8B-shaped model, random bf16 weights).

On the CPU both engines live side by side and are measured in alternation, round after round (the median round
is reported), so a busy or drifting machine weighs on both alike. On a GPU each mode runs in a process of its
own (its cuBLAS settings are the process's). Each also runs the check the setting exists for:
one seeded request's logits, bit for bit, alone / beside seven others / computed in chunks / resumed after its
first tokens (its output recomputed as prompt) -- `holds` says whether all four were equal.

Prints a table, then one JSON line: {device, model, rounds, off: {...}, on: {...}, cost: {...}}, where each mode
has prefill_tok_s, decode_tok_s (per batch size) and holds, and cost is 1 - on / off per measure.

  CPU:  python benchmarks/batch_invariance.py --save cpu2
  GPU:  python benchmarks/batch_invariance.py --device cuda --save h200
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

LLAMA8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "tie_word_embeddings": False, "eos_token_id": 128001}
RESULTS = Path(__file__).resolve().parent / "results"


def build(args, invariant: bool):
    from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.engine.llm_engine import LLMEngine

    cuda = args.device == "cuda"
    path, dummy = args.model, False
    if args.model == "llama8b":
        path, dummy = tempfile.mkdtemp(prefix="splitserve-bench-"), True
        Path(path, "config.json").write_text(json.dumps(LLAMA8B))
    torch.manual_seed(0)  # dummy weights alike in both modes
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(path, dtype="bfloat16" if cuda else "float32", device=args.device,
                          max_model_len=args.max_model_len, load_format="dummy" if dummy else "auto",
                          batch_invariant=invariant),
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=max(64, max(args.batches))),
    ))
    return engine


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def prefill_rate(engine, args, seed: int) -> float:
    """Tokens/s computing `--prefill-prompts` prompts of `--prefill-len` tokens (one output token each; new
    prompts every round, so none is cached)."""
    from splitserve.engine import SamplingParams

    batch = prompts(engine.arch.vocab_size, args.prefill_prompts, args.prefill_len, seed)
    sync(args.device)
    t0 = time.perf_counter()
    engine.generate(batch, SamplingParams(max_tokens=1, temperature=0))
    sync(args.device)
    return len(batch) * args.prefill_len / (time.perf_counter() - t0)


def decode_rate(engine, args, batch: int, tag: str) -> float:
    """Tokens/s of `--decode-steps` decode steps of `batch` greedy requests at `--context` tokens of context. The
    contexts are the same every round (the first `batch` of one set): after the first round the prefix cache
    holds them, and a round computes little more than its decode steps."""
    from splitserve.engine import SamplingParams

    steps = args.decode_steps
    for i, p in enumerate(prompts(engine.arch.vocab_size, max(args.batches), args.context, 99)[:batch]):
        engine.add_request(f"dec-{tag}-{i}", p, SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    engine.step()
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(args.device)
    rate = batch * steps / (time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    return rate


def holds(engine, args) -> dict[str, bool]:
    """One seeded request's logits, bit for bit: alone, beside seven others, with its prompt cut into chunks,
    and resumed after 3 tokens (prompt + those tokens computed as its prompt, output_offset 3)."""
    from splitserve.engine import SamplingParams

    rows: dict[str, list[torch.Tensor]] = defaultdict(list)
    sampler = engine.runner.sampler
    inner = sampler.sample

    def tap(logits, requests):
        for i, r in enumerate(requests):
            rows[r.request_id].append(logits[i].float().cpu())
        return inner(logits, requests)

    sampler.sample = tap
    engine.scheduler.pool.enable_caching = False  # each run computes the whole prompt, its own way
    vocab = engine.arch.vocab_size
    prompt = prompts(vocab, 1, args.check_len, 7)[0]

    def sp(n: int, offset: int = 0, seed: int = 7) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.9, seed=seed, ignore_eos=True, output_offset=offset)

    def run(rid: str, tokens: list[int], params: SamplingParams) -> list[int]:
        engine.add_request(rid, tokens, params)
        out: list[int] = []
        while engine.has_unfinished():
            out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        return out

    try:
        out = run("alone", prompt, sp(6))
        for j, n in enumerate((5, 40, 130, 300, 17, 64, 450)):
            engine.add_request(f"other{j}", prompts(vocab, 1, n, 100 + j)[0], sp(12, seed=j))
        run("beside", prompt, sp(6))
        budget = engine.scheduler.config.max_num_batched_tokens
        engine.scheduler.config.max_num_batched_tokens = 100  # the prompt in chunks of 100 tokens
        run("chunked", prompt, sp(6))
        engine.scheduler.config.max_num_batched_tokens = budget
        run("resumed", prompt + out[:3], sp(3, offset=3))
    finally:
        del sampler.sample  # the instance attribute: the method again
        engine.scheduler.pool.enable_caching = True

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    return {"beside_seven": same(rows["beside"], rows["alone"]), "chunked": same(rows["chunked"], rows["alone"]),
            "resumed": same(rows["resumed"], rows["alone"][3:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="a model name or directory; llama8b: an 8B shape with random "
                                                  "weights [default: smollm2 on cpu, llama8b on cuda]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-prompts", type=int, default=None, help="[default: 4 on cpu, 16 on cuda]")
    ap.add_argument("--prefill-len", type=int, default=None, help="[default: 512 on cpu, 2048 on cuda]")
    ap.add_argument("--context", type=int, default=None, help="decode: prompt tokens per request [default: 512 on "
                                                              "cpu, 1024 on cuda]")
    ap.add_argument("--batches", default=None, help="decode batch sizes [default: 1,8,32 on cpu, 1,16,64 on cuda]")
    ap.add_argument("--decode-steps", type=int, default=None, help="[default: 16 on cpu, 64 on cuda]")
    ap.add_argument("--check-len", type=int, default=700, help="prompt tokens of the invariance check")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory", default=None, help="[default: 1GiB on cpu, 24GiB on cuda]")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--save", metavar="NAME", help="write benchmarks/results/batch_invariance_NAME.json")
    ap.add_argument("--only", choices=["off", "on"], help=argparse.SUPPRESS)  # one mode, its samples as JSON
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model = args.model or ("llama8b" if cuda else "smollm2")
    args.prefill_prompts = args.prefill_prompts or (16 if cuda else 4)
    args.prefill_len = args.prefill_len or (2048 if cuda else 512)
    args.batches = [int(b) for b in (args.batches or ("1,16,64" if cuda else "1,8,32")).split(",")]
    args.decode_steps = args.decode_steps or (64 if cuda else 16)
    args.context = args.context or (1024 if cuda else 512)
    args.kv_cache_memory = args.kv_cache_memory or ("24GiB" if cuda else "1GiB")

    if args.only:
        print(json.dumps(measure(args, [args.only])[args.only]))
        return
    if cuda:
        runs = {}
        for mode in ("off", "on"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--only", mode]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"mode {mode} failed (rc={res.returncode}):\n{res.stderr[-3000:]}")
            runs[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    else:
        runs = measure(args, ["off", "on"])
    report(args, runs)


def measure(args, modes: list[str]) -> dict[str, dict]:
    """Per mode: median prefill and decode rates over the rounds, and the check."""
    engines = {mode: build(args, mode == "on") for mode in modes}
    for engine in engines.values():  # warm-up: kernels compiled, allocator settled
        prefill_rate(engine, argparse.Namespace(**{**vars(args), "prefill_prompts": 1, "prefill_len": 64}), 12345)
    samples: dict[str, dict[str, list[float]]] = {m: defaultdict(list) for m in engines}
    for r in range(args.rounds):
        for mode, engine in engines.items():
            samples[mode]["prefill"].append(prefill_rate(engine, args, seed=r))
            for b in args.batches:
                samples[mode][f"decode_b{b}"].append(decode_rate(engine, args, b, tag=f"{r}-{b}"))
    return {mode: {"prefill_tok_s": statistics.median(samples[mode]["prefill"]),
                   "decode_tok_s": {str(b): statistics.median(samples[mode][f"decode_b{b}"]) for b in args.batches},
                   "holds": holds(engine, args)} for mode, engine in engines.items()}


def report(args, runs: dict[str, dict]) -> None:
    cuda = args.device == "cuda"
    result: dict = {"device": torch.cuda.get_device_name() if cuda else f"cpu x{torch.get_num_threads()} threads",
                    "model": args.model, "rounds": args.rounds, "prefill_prompts": args.prefill_prompts,
                    "prefill_len": args.prefill_len, "context": args.context, "decode_steps": args.decode_steps}
    result.update(runs)
    keys = ["prefill", *[f"decode_b{b}" for b in args.batches]]
    off = [result["off"]["prefill_tok_s"], *result["off"]["decode_tok_s"].values()]
    on = [result["on"]["prefill_tok_s"], *result["on"]["decode_tok_s"].values()]
    result["cost"] = {k: 1 - b / a for k, a, b in zip(keys, off, on, strict=True)}

    print(f"{result['device']}, {args.model}: prefill {args.prefill_prompts} x {args.prefill_len} tokens; decode "
          f"{args.decode_steps} steps at {args.context} tokens of context; median of {args.rounds} rounds")
    print(f"{'measure':<14}{'off tok/s':>12}{'on tok/s':>12}{'cost':>9}")
    for k, a, b in zip(keys, off, on, strict=True):
        print(f"{k:<14}{a:>12.1f}{b:>12.1f}{1 - b / a:>9.1%}")
    for mode in runs:
        print(f"{mode}: holds {result[mode]['holds']}")
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"batch_invariance_{args.save}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
