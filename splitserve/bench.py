"""`splitserve bench`: an asyncio load generator for any OpenAI-compatible server.

Open-loop arrivals (Poisson at --rate, or the arrival times of a trace: samples in benchmarks/traces/),
token-id prompts of exact lengths (Mooncake hash ids become shared 512-token prefix blocks), streaming
completions. Reports TTFT, inter-token latency and end-to-end percentiles, output tokens/s and goodput
(requests/s that met both --slo-ttft and --slo-itl); --json adds a machine-readable last line, --plot writes
latency CDFs (of the completed requests; the failed ones are counted in the title). More failed requests than
--max-failure-rate is a failed run (exit 1).
"""

from __future__ import annotations

import asyncio
import csv
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HASH_BLOCK = 512  # tokens per Mooncake hash id


@dataclass
class Job:
    arrival: float  # seconds from the start
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""


def _block(hash_id: int, vocab: tuple[int, int]) -> list[int]:
    rng = random.Random(hash_id * 7919 + 17)
    return [rng.randrange(*vocab) for _ in range(HASH_BLOCK)]


def load_trace(path: str, n: int, time_scale: float, max_in: int, max_out: int, vocab: tuple[int, int],
               seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    p = Path(path)
    if p.suffix == ".jsonl":
        with open(p) as f:
            for line in f:
                r = json.loads(line)
                blocks = [t for h in r.get("hash_ids", []) for t in _block(h, vocab)]
                length = max(1, min(r["input_length"], max_in))
                prompt = (blocks + [rng.randrange(*vocab) for _ in range(length)])[:length]
                jobs.append(Job(r["timestamp"] / 1000.0 * time_scale, prompt, max(1, min(r["output_length"], max_out))))
                if len(jobs) >= n:
                    break
    elif p.suffix == ".csv":
        with open(p) as f:
            for r in csv.DictReader(f):
                length = max(1, min(int(r["num_prefill_tokens"]), max_in))
                jobs.append(Job(float(r["arrived_at"]) * time_scale, [rng.randrange(*vocab) for _ in range(length)],
                                max(1, min(int(r["num_decode_tokens"]), max_out))))
                if len(jobs) >= n:
                    break
    else:
        raise ValueError(f"unknown trace format {p.suffix!r} (use .jsonl Mooncake or .csv Azure)")
    if not jobs:
        raise ValueError(f"trace {path} has no requests")
    t0 = jobs[0].arrival
    for j in jobs:
        j.arrival -= t0
    return jobs


def poisson_jobs(n: int, rate: float, input_len: int, output_len: int, vocab: tuple[int, int], seed: int) -> list[Job]:
    rng = random.Random(seed)
    t = 0.0
    jobs = []
    for _ in range(n):
        jobs.append(Job(t, [rng.randrange(*vocab) for _ in range(input_len)], output_len))
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return jobs


async def one(client: httpx.AsyncClient, url: str, model: str, job: Job) -> Result:
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"].get("message", "error")
                    return res
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(url: str, model: str, jobs: list[Job], timeout: float, progress: bool) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    done = 0

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def fire(job: Job) -> Result:
            nonlocal done
            await asyncio.sleep(max(0.0, start + job.arrival - time.perf_counter()))
            r = await one(client, url, model, job)
            done += 1
            if progress:
                bar = "#" * int(30 * done / len(jobs))
                print(f"\r[{bar:<30}] {done}/{len(jobs)}", end="", file=sys.stderr, flush=True)
            return r

        results = await asyncio.gather(*(fire(j) for j in jobs))
        elapsed = time.perf_counter() - start
    if progress:
        print(file=sys.stderr)
    return list(results), elapsed


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


def summarize(results: list[Result], elapsed: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    e2e = [r.e2e for r in ok]
    good = [r for r in ok if r.ttft <= slo_ttft and (not r.itls or pct(r.itls, 99) <= slo_itl)]
    out = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
           "duration_s": round(elapsed, 3)}
    for name, vals in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 95, 99):
            v = pct(vals, q)
            out[f"{name}_p{q}_s"] = None if v is None else round(v, 4)
    tokens = sum(r.output_tokens or (len(r.itls) + 1) for r in ok)
    out["output_tokens"] = tokens
    out["output_tok_s"] = round(tokens / elapsed, 2) if elapsed > 0 else None
    out["goodput_rps"] = round(len(good) / elapsed, 3) if elapsed > 0 else None
    out["request_rps"] = round(len(ok) / elapsed, 3) if elapsed > 0 else None
    out["slo_ttft_s"], out["slo_itl_s"] = slo_ttft, slo_itl
    errors = sorted({r.error for r in results if not r.ok})
    out["errors"] = errors[:5]
    return out


def failure_problem(summary: dict, max_failure_rate: float) -> str | None:
    """One line when more requests failed than `max_failure_rate` (a fraction) allows; None otherwise."""
    failed, n = summary["failed"], summary["requests"]
    if n and failed / n > max_failure_rate:
        first = summary["errors"][0] if summary["errors"] else "unknown"
        return (f"{failed} of {n} requests failed ({failed / n:.1%} > --max-failure-rate {max_failure_rate:g}); "
                f"first error: {first}")
    return None


def plot_title(results: list[Result]) -> str:
    """What the CDFs show, and what they leave out."""
    failed = sum(1 for r in results if not r.ok)
    title = f"{len(results) - failed} completed requests"
    return title + (f"; {failed} failed requests not shown" if failed else "")


def check_plot(path: str) -> None:
    """Before a run: plotting can happen at its end (matplotlib importable, the file writable)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)")
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise RuntimeError(f"--plot: directory {parent} does not exist")


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, vals) in zip(axes, (("TTFT (s)", [r.ttft for r in ok]),
                                       ("inter-token latency (s)", [x for r in ok for x in r.itls]),
                                       ("end-to-end (s)", [r.e2e for r in ok])), strict=True):
        s = sorted(vals)
        ax.plot(s, [(i + 1) / len(s) for i in range(len(s))] if s else [])
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.suptitle(plot_title(results), color="black" if len(ok) == len(results) else "firebrick")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(s: dict) -> None:
    print(f"requests {s['requests']}  completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']} s")
    print(f"{'metric':<10}{'p50':>10}{'p95':>10}{'p99':>10}")
    for name in ("ttft", "itl", "e2e"):
        row = [s[f"{name}_p{q}_s"] for q in (50, 95, 99)]
        print(f"{name:<10}" + "".join(f"{'-' if v is None else f'{v:.4f}':>10}" for v in row))
    print(f"output tok/s {s['output_tok_s']}  goodput {s['goodput_rps']} req/s "
          f"(SLO ttft<={s['slo_ttft_s']} s, itl<={s['slo_itl_s']} s)")
    if s["errors"]:
        print(f"errors: {s['errors']}")
