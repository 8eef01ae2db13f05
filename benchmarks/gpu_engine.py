"""The engine on a GPU, measured against the hardware floors measured in the same run.

1. decode step time for a Llama-3.1-8B-shaped model (random bf16 weights) at batch 1/8/32/128, 1k-token
   contexts, steps back to back with and without the overlapped step (host work of step N+1 while step N runs),
   against the bucket's CUDA graph replayed alone and floor = (weight bytes + KV bytes read) / copy bandwidth
2. prefill throughput at 2k and 8k-token prompts as a fraction of the measured bf16 matmul rate (MFU)
3. offline throughput against Hugging Face `generate` on the same GPU (--offline-prompts x 512 in / 256 out)
4. a Qwen3-30B-A3B-shaped MoE: decode tokens/s at batch 64 with EP=1 and, on a 2-GPU host, EP=2 and TP=2
5. (extras) each fused kernel against the PyTorch ops it replaces, and the 8B decode step at TP=2
Writes one JSON file under benchmarks/results/ (or --out) and prints a table, then the JSON line. With
--update FILE the parts run now replace those parts of FILE's results and the rest are kept (one machine
may run the single-GPU parts and a 2-GPU host the parallel ones).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import LLAMA8B, QWEN3_30B_A3B, out_path


def model_dir(cfg: dict) -> str:
    d = tempfile.mkdtemp(prefix="splitserve-bench-")
    Path(d, "config.json").write_text(json.dumps(cfg))
    return d


def copy_gbps() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * n / statistics.median(ts) / 1e9  # bytes read + written


def matmul_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        a @ b
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * n**3 / statistics.median(ts) / 1e12


def engine_for(path: str, max_len: int, budget: int, seqs: int, kv: str, tp: int = 1, ep: bool = False):
    from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.engine.config import ParallelConfig
    from splitserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=ModelConfig(path, dtype="bfloat16", device="cuda", max_model_len=max_len, load_format="dummy"),
        cache=CacheConfig(kv_cache_memory=kv, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs),
        parallel=ParallelConfig(tp, ep),
    ))


def gpu_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters * 1e3


def fusions() -> list[dict]:
    """Each fused kernel against the PyTorch ops it replaces, at 8B decode shapes (microseconds per call)."""
    import torch.nn.functional as F

    from splitserve.engine.kernels.triton_norm_rope import add_rms_norm, rms_norm, rotary_inplace, silu_mul

    def torch_norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    def torch_rope(x, cos, sin):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.addcmul(xf * cos, torch.cat([-x2, x1], dim=-1), sin).to(x.dtype)

    def measure(rows: int) -> list[dict]:
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16)
        cos = torch.randn(rows, 1, 128, device="cuda")
        sin = torch.randn(rows, 1, 128, device="cuda")
        gu = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16)
        cases = {
            "rms_norm": (lambda: rms_norm(x, w, 1e-5), lambda: torch_norm(x, w)),
            "add_rms_norm": (lambda: add_rms_norm(x, r, w, 1e-5), lambda: torch_norm(r.add_(x), w)),
            "rotary": (lambda: rotary_inplace(q, cos, sin), lambda: torch_rope(q, cos, sin)),
            "silu_mul": (lambda: silu_mul(gu), lambda: F.silu(gu[:, :14336]) * gu[:, 14336:]),
        }
        found = []
        for name, (fused, eager) in cases.items():
            f_us, t_us = gpu_us(fused), gpu_us(eager)
            found.append({"kernel": name, "rows": rows, "fused_us": f_us, "torch_us": t_us})
            print(f"fusion {name:>13} rows {rows:>3}: fused {f_us:6.1f} us, torch ops {t_us:6.1f} us", flush=True)
        return found

    return measure(1) + measure(128)


def weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def decode_steps(engine, batch: int, context: int, steps: int = 20, overlap: bool = True) -> float:
    """Seconds per decode step at `batch`, steps run back to back as in serving (with the overlapped step, a
    step's host work runs while the previous one is on the GPU; `overlap=False` reads every step's tokens before
    scheduling the next)."""
    from splitserve.engine import SamplingParams

    engine.overlap = overlap

    g = torch.Generator().manual_seed(batch)
    vocab = engine.arch.vocab_size
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
        engine.add_request(f"d{batch}-{i}", prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    # on the device's clock: each step's inputs-and-replay span, and the idle gap before it (the host's share)
    graphs = engine.runner.graphs
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    real_run = graphs.run if graphs is not None else None

    def timed_run(batch, feed=None):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = real_run(batch, feed)
        end.record()
        spans.append((begin, end))
        return out

    if graphs is not None:
        graphs.run = timed_run
    ts = []
    try:
        for _ in range(3):  # three windows of steps/3 steps each; the median window
            t0 = time.perf_counter()
            for _ in range(steps // 3):
                engine.step()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / (steps // 3))
    finally:
        if graphs is not None:
            del graphs.run  # the instance attribute: the method again
    gaps = [a[1].elapsed_time(b[0]) for a, b in zip(spans, spans[1:], strict=False)]
    engine.last_gpu_gap_ms = statistics.median(gaps) if gaps else None
    engine.last_gpu_span_ms = statistics.median(a.elapsed_time(b) for a, b in spans) if spans else None
    graph_ms = None
    graphs = engine.runner.graphs
    # GPU time alone: replay the bucket's graph (one process only: a sharded graph waits on its peers)
    if graphs is not None and engine.parallel is None and batch <= graphs.max_batch:
        g = graphs.graphs[next(x for x in graphs.buckets if x >= batch)][0]
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for _ in range(steps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        graph_ms = e0.elapsed_time(e1) / steps
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)
    engine.step()  # hand out what the aborts' settle read
    engine.overlap = True
    engine.last_graph_ms = graph_ms
    return statistics.median(ts)


def prefill_rate(engine, tokens: int) -> float:
    from splitserve.engine import SamplingParams

    vocab = engine.arch.vocab_size
    prompt = torch.randint(0, vocab, (tokens,)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # warm-up
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.generate([torch.randint(0, vocab, (tokens,)).tolist()], SamplingParams(max_tokens=1, temperature=0))
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return tokens / statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--offline-prompts", type=int, default=256)
    ap.add_argument("--skip", default="",
                    help="comma list of parts to skip: decode,prefill,offline,hf,moe,fusions,parallel")
    ap.add_argument("--update", default="", help="results file whose other parts are kept")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name(0)
    res = {"device": dev, "copy_gbps": copy_gbps(), "matmul_tflops": matmul_tflops(), "decode": None,
           "prefill": None, "offline": None, "moe": None, "fusions": None, "tp_decode": None, "notes": []}
    if args.update:
        kept = json.loads(Path(args.update).read_text())
        if kept.get("device") != dev:
            raise SystemExit(f"--update: {args.update} was measured on {kept.get('device')}, this is {dev}")
        res.update({k: v for k, v in kept.items() if k not in ("copy_gbps", "matmul_tflops")})
        res.setdefault("notes", [])
        res["copy_gbps_runs"] = [kept["copy_gbps"], res["copy_gbps"]]
    print(f"device {dev}: copy {res['copy_gbps']:.0f} GB/s (read+write), bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s",
          flush=True)
    if "fusions" not in skip:
        res["fusions"] = fusions()
    dense = model_dir(LLAMA8B)
    eng = engine_for(dense, 16384, 16384, 256, "40GiB") if {"decode", "prefill", "offline"} - skip else None
    wbytes = weight_bytes(eng) if eng is not None else 0
    kv_per_token = 2 * 32 * 8 * 128 * 2
    if "decode" not in skip:
        res["decode"] = []
        for b in map(int, args.batches.split(",")):
            serial = decode_steps(eng, b, args.context, overlap=False)
            step = decode_steps(eng, b, args.context)
            floor = (wbytes + b * (args.context + 10) * kv_per_token) / (res["copy_gbps"] * 1e9)
            gms = eng.last_graph_ms
            res["decode"].append({"batch": b, "context": args.context, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                                  "bw_util": floor / step, "graph_replay_ms": gms,
                                  "step_no_overlap_ms": serial * 1e3,
                                  "step_over_replay": step * 1e3 / gms if gms else None,
                                  "gpu_span_ms": eng.last_gpu_span_ms, "gpu_gap_ms": eng.last_gpu_gap_ms})
            print(f"decode batch {b:>4}: {step * 1e3:8.2f} ms/step ({serial * 1e3:.2f} without overlap; GPU graph "
                  f"alone {gms or 0:.2f} ms; per step on the GPU {eng.last_gpu_span_ms or 0:.2f} ms, idle between "
                  f"steps {eng.last_gpu_gap_ms or 0:.3f} ms), floor {floor * 1e3:6.2f} ms, util {floor / step:.2f}",
                  flush=True)
    if "prefill" not in skip:
        res["prefill"] = []
        # matmul parameters: everything but the embedding table and the LM head (run for the last token only)
        params = wbytes / 2 - 2 * LLAMA8B["vocab_size"] * LLAMA8B["hidden_size"]
        for tokens in (2048, 8192):
            rate = prefill_rate(eng, tokens)
            attn = 4 * 32 * (tokens / 2) * 4096  # causal QK^T and PV: 2 matmuls x 2 FLOPs x layers x mean context x dim
            flops_per_token = 2 * params + attn
            mfu = rate * flops_per_token / (res["matmul_tflops"] * 1e12)
            res["prefill"].append({"tokens": tokens, "tok_s": rate, "mfu": mfu})
            print(f"prefill {tokens:>5} tokens: {rate:9.0f} tok/s, MFU {mfu:.2f}", flush=True)
    if "offline" not in skip:
        from splitserve.engine import SamplingParams

        n = args.offline_prompts
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 128256, (512,), generator=g).tolist() for _ in range(n)]
        sp = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        out = eng.generate(prompts, sp)
        torch.cuda.synchronize()
        ours = sum(len(r["token_ids"]) for r in out) / (time.perf_counter() - t0)
        model = eng.runner.model
        eng.close()
        del eng, out
        hf_tok_s = None
        if "hf" not in skip:  # Hugging Face generate on the same GPU, for scale
            try:
                from transformers import AutoModelForCausalLM, LlamaConfig

                cfg = LlamaConfig(**{k: v for k, v in LLAMA8B.items() if k not in ("architectures", "model_type")})
                with torch.device("cuda"):
                    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
                ids = torch.tensor(prompts, device="cuda")
                with torch.no_grad():
                    hf.generate(ids[:2], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    o = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=256, min_new_tokens=256,
                                    do_sample=False, pad_token_id=0)
                    torch.cuda.synchronize()
                hf_tok_s = (o.shape[1] - 512) * n / (time.perf_counter() - t0)
                del hf
            except Exception as e:  # keep the rest of the results
                res["notes"].append(f"hf generate failed: {e}")
        res["offline"] = {"prompts": n, "input_len": 512, "output_len": 256, "ours_tok_s": ours, "hf_tok_s": hf_tok_s,
                          "ratio": ours / hf_tok_s if hf_tok_s else None}
        print(f"offline {n} x 512/256: ours {ours:.0f} tok/s, hf {hf_tok_s} tok/s", flush=True)
        del model
    else:
        del eng
    torch.cuda.empty_cache()
    two_gpus = torch.cuda.device_count() >= 2
    runs = [(1, 1)] if "moe" not in skip else []
    if two_gpus and "parallel" not in skip:
        runs += [(2, 1), (1, 2)]  # EP=2 (attention tensor-parallel over the 2 GPUs), TP=2
    if runs:
        res["moe"] = [m for m in (res.get("moe") or []) if m["tok_s"] is not None]
        for ep, tp in runs:
            world = max(ep, tp)
            moe = engine_for(model_dir(QWEN3_30B_A3B), 4096, 8192, 64, "16GiB", tp=world, ep=ep > 1)
            step = decode_steps(moe, 64, 512, steps=10)
            gms = moe.last_graph_ms
            moe.close()
            del moe
            torch.cuda.empty_cache()
            res["moe"] = [m for m in res["moe"] if (m["ep"], m["tp"]) != (ep, tp)]
            res["moe"].append({"ep": ep, "tp": tp, "gpus": world, "batch": 64, "tok_s": 64 / step,
                               "step_ms": step * 1e3, "graph_replay_ms": gms})
            print(f"moe qwen3-30b-a3b shape, EP={ep} TP={tp}, batch 64: {64 / step:.0f} tok/s "
                  f"({step * 1e3:.1f} ms/step)", flush=True)
        for ep, tp in ((1, 1), (2, 1), (1, 2)):
            if not any((m["ep"], m["tp"]) == (ep, tp) for m in res["moe"]):
                res["moe"].append({"ep": ep, "tp": tp, "batch": 64, "tok_s": None})
    if two_gpus and "parallel" not in skip:
        eng = engine_for(dense, 4096, 8192, 32, "16GiB", tp=2)
        res["tp_decode"] = []
        for b in (1, 32):
            step = decode_steps(eng, b, args.context)
            res["tp_decode"].append({"tp": 2, "batch": b, "context": args.context, "step_ms": step * 1e3,
                                     "graph_replay_ms": eng.last_graph_ms})
            print(f"decode 8B TP=2 batch {b:>3}: {step * 1e3:.2f} ms/step", flush=True)
        eng.close()
    out = out_path(f"gpu_engine_{dev.replace(' ', '_').lower()}.json", args.out)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
