"""vLLM on one GPU, measured the way `benchmarks/gpu_engine.py` measures the native engine, so the two sit side by
side in `benchmarks/results/engine_vllm_gpu_*.json`.

The model is the same Llama-3.1-8B shape with random bf16 weights (vLLM's `load_format="dummy"`, our engine's
random init): offline throughput for 256 prompts x 512 random ids with 256 new tokens each (greedy,
`ignore_eos`), and the decode step at batch 1 and 128 with 1k-token contexts. vLLM's step is read from whole
requests: (median of generate(max_tokens=64) - median of generate(max_tokens=1)) / 63, so it holds the
scheduler's and sampler's host work of each step as the native figure does. With --native FILE the native
engine's results (a gpu_engine.py JSON from the same host) are folded into the table.
Prints a table, then the JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import LLAMA8B, out_path  # the shape gpu_engine.py measures


def _prompts(n: int, length: int, seed: int) -> list[dict]:
    ids = np.random.default_rng(seed).integers(0, LLAMA8B["vocab_size"], size=(n, length))
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--native", default="", help="gpu_engine.py results from the same host, shown beside")
    ap.add_argument("--offline-prompts", type=int, default=256)
    ap.add_argument("--out", default="", help="result file (default: benchmarks/results/engine_vllm_gpu.json)")
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    d = tempfile.mkdtemp(prefix="splitserve-vllm-")
    Path(d, "config.json").write_text(json.dumps({**LLAMA8B, "torch_dtype": "bfloat16"}))
    kwargs = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 2048, "gpu_memory_utilization": 0.85,
              "enable_prefix_caching": False, "skip_tokenizer_init": True, "seed": 0}
    res: dict = {"device": torch.cuda.get_device_name(0), "vllm_version": vllm.__version__,
                 "torch_version": torch.__version__, "llm_kwargs": kwargs}
    t0 = time.perf_counter()
    llm = LLM(model=d, **kwargs)
    res["startup_s"] = round(time.perf_counter() - t0, 1)

    def run(prompts: list[dict], max_tokens: int) -> tuple[float, int]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    offline = _prompts(args.offline_prompts, 512, 1)
    run(offline[:8], 256)  # warm-up
    runs = []
    for _ in range(2):
        dt, n = run(offline, 256)
        runs.append({"seconds": round(dt, 3), "tokens": n, "tok_s": round(n / dt, 1)})
        print(f"offline: {runs[-1]}", flush=True)
    res["offline"] = {"prompts": args.offline_prompts, "input_len": 512, "output_len": 256,
                      "tok_s": max(r["tok_s"] for r in runs), "runs": runs}
    res["decode"] = []
    for batch in (1, 128):
        prompts = _prompts(batch, 1024, 100 + batch)
        run(prompts, 2)
        t1 = [run(prompts, 1)[0] for _ in range(3)]
        t64 = [run(prompts, 64)[0] for _ in range(3)]
        step = (statistics.median(t64) - statistics.median(t1)) / 63
        res["decode"].append({"batch": batch, "context": 1024, "step_ms": round(step * 1e3, 3),
                              "t1_s": [round(x, 4) for x in t1], "t64_s": [round(x, 4) for x in t64]})
        print(f"decode batch {batch}: {step * 1e3:.2f} ms/step", flush=True)

    native = json.loads(Path(args.native).read_text()) if args.native else None
    rows = [("offline 256x512/256 tok/s", res["offline"]["tok_s"],
             native["offline"]["ours_tok_s"] if native and native.get("offline") else None)]
    for entry in res["decode"]:
        theirs = next((x["step_ms"] for x in (native or {}).get("decode") or [] if x["batch"] == entry["batch"]),
                      None)
        rows.append((f"decode step ms, batch {entry['batch']}, 1k context", entry["step_ms"], theirs))
    res["native"] = {"offline_tok_s": rows[0][2], "decode_step_ms": {str(e["batch"]): r[2]
                                                                     for e, r in zip(res["decode"], rows[1:], strict=True)}}
    print(f"\n| {res['device']} | vLLM {res['vllm_version']} | native | vLLM / native |\n| --- | --- | --- | --- |")
    for name, v, n in rows:
        print(f"| {name} | {v:.2f} | {n if n is None else f'{n:.2f}'} | {'' if not n else f'{v / n:.2f}x'} |")
    out_path("engine_vllm_gpu.json", args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
