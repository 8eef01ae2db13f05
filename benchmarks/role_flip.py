"""Role flips on this CPU (issue 40): seconds from `splitserve flip` to the gateway seeing the worker serve its new
role, with --streams streams running on the worker flipped.

`splitserve up` with one prefill and two decode workers (SmolLM2 on --device, the bundled Redis, round-robin
routing, so each decode worker gets half the streams). Each round sends 2 x --streams seeded streams (temperature 0.9,
--max-tokens each); once every stream has a few tokens, the busier decode worker is flipped to prefill
(`splitserve flip --drain-seconds D`: what is still running after D seconds moves to the other decode worker).
Once the streams have ended, the same worker is flipped back to decode with --prefills long prompts in flight
on it (their prefills finish first). Per flip:

  command_s   the `splitserve flip` process's wall time, from its start to its exit 0 (its interpreter's start
              included: ~2 s of imports on a busy 2-core box)
  gateway_s   what the command prints: from the gateway's receiving the request to its view having the worker
              up in its new role
  worker_s    the worker's own part: its drain, the other role's service built, its registry entry rewritten
  moved       streams that moved to the other decode worker (the rest finished within the drain)

Every stream must complete (finish_reason length, its whole --max-tokens) or the run fails. The goal (issue 40):
command_s <= 5 s with 4 streams on the worker flipped. Prints a table (logs on stderr), ends with one JSON line
(`command_s_p50`, `command_s_max`, `gateway_s_p50`, `worker_s_p50`, `back_command_s_p50`, `streams`,
`moved_streams`, `lost_streams`, `goal_s`, `meets_goal`, `load_1m`), and writes
benchmarks/results/role_flip_NAME.json and .md (--save NAME, default cpu2; --no-save to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
from harness import BIN, Cluster, fmt, http_json, report, save, warm_up

GOAL_S = 5.0
CLUSTER = """apiVersion: splitserve.dev/v1alpha1
kind: SplitServeCluster
metadata: {{name: role-flip}}
spec:
  model: {{name: {model}, servedModelName: smollm2, dtype: {dtype}, device: {device}, maxModelLen: 1024,
          loadFormat: {load_format}}}
  mode: disaggregated
  redis: {{mode: bundled}}
  prefill: {{replicas: 1, engine: {{kvCacheMemory: 128MiB}}}}
  decode: {{replicas: 2, disaggThreshold: {threshold}, engine: {{kvCacheMemory: 256MiB}}}}
  router: {{policy: round_robin, stallSeconds: 30}}
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def streams(url: str, n: int, max_tokens: int, round_: int, when: int, then) -> list[dict[str, Any]]:
    """`n` seeded streams at once; once each has `when` text chunks, `then()` runs (once). Each stream's end."""
    ends = [{"chunks": 0, "finish": None, "tokens": 0, "error": None} for _ in range(n)]
    reached = asyncio.Event()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "smollm2", "prompt": f"Round {round_}, story {i}: once upon a time,", "max_tokens": max_tokens,
                "temperature": 0.9, "seed": 1000 * round_ + i, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        end = ends[i]
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    end["error"] = event["error"]["message"]
                    continue
                if event.get("usage"):
                    end["tokens"] = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    end["chunks"] += bool(choice["text"])
                    end["finish"] = choice["finish_reason"] or end["finish"]
                if all(e["chunks"] >= when for e in ends):
                    reached.set()

    async def trigger() -> None:
        async with asyncio.timeout(600):
            await reached.wait()
        then()

    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        await asyncio.gather(*(one(client, i) for i in range(n)), trigger())
    return ends


def flip(url: str, worker: str, role: str, drain_s: float) -> dict[str, Any]:
    """`splitserve flip` as a process: its wall time and what it printed; RuntimeError unless it exits 0."""
    t0 = time.monotonic()
    done = subprocess.run([str(BIN / "splitserve"), "flip", "--url", url, "--worker", worker, "--to", role,
                           "--drain-seconds", str(drain_s)], capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    said = re.search(r"after ([0-9.]+) s; (\d+) streams moved", done.stdout)
    if done.returncode != 0 or said is None:
        raise RuntimeError(f"splitserve flip {worker} --to {role}: exit {done.returncode}: {done.stderr.strip()}")
    return {"worker": worker, "to": role, "command_s": round(wall, 3), "gateway_s": float(said[1]),
            "moved": int(said[2])}


def worker_seconds(metrics_url: str, target: str) -> float:
    """The seconds of the worker's flips to `target` so far (its splitserve_role_flip_seconds sum: a caller
    differences two reads)."""
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("splitserve_role_flip_seconds_sum") and f'target="{target}"' in line)


def post(url: str, prompt: str) -> None:
    body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def one_round(c: Cluster, i: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A flip to prefill under streams, then back to decode under prefills; each flip's numbers."""
    url, out, box = c.url, [], {}

    def flip_busier() -> None:
        decode = [w for w in http_json(url + "/health")["workers"] if w["role"] == "decode"]
        victim = max(decode, key=lambda w: w["outstanding"])
        box["victim"], box["streams"] = victim["name"], victim["outstanding"]
        box["metrics"] = next(w["metrics"] for w in c.components["decode"] if w["name"] == victim["name"])
        box["before"] = worker_seconds(box["metrics"], "prefill")
        box["thread"] = threading.Thread(target=lambda: box.update(
            result=flip(url, victim["name"], "prefill", args.drain_seconds)))
        box["thread"].start()

    ends = asyncio.run(streams(url, 2 * args.streams, args.max_tokens, i, args.when, flip_busier))
    box["thread"].join(300)
    if "result" not in box:
        raise RuntimeError("the flip to prefill did not end")
    lost = [e for e in ends if e["finish"] != "length" or e["tokens"] != args.max_tokens or e["error"]]
    metrics_url = box["metrics"]
    done = box["result"] | {"direction": "decode->prefill", "streams": box["streams"], "lost": len(lost),
                            "worker_s": round(worker_seconds(metrics_url, "prefill") - box["before"], 3)}
    out.append(done)
    log(f"  round {i}: {json.dumps(done)}")
    if lost:
        raise RuntimeError(f"{len(lost)} streams did not complete: {lost[:3]}")

    # back to decode while long prompts are in flight on it (round robin: half of them to each prefill worker)
    before = worker_seconds(metrics_url, "decode")
    long_prompt = "Tell me about the river and the hills. " * 40
    senders = [threading.Thread(target=post, args=(url, f"{i}.{k} {long_prompt}")) for k in range(args.prefills)]
    for t in senders:
        t.start()
    time.sleep(args.prefill_lead)
    back = flip(url, box["victim"], "decode", args.drain_seconds)
    for t in senders:
        t.join(600)
    back |= {"direction": "prefill->decode", "streams": 0, "lost": 0,
             "worker_s": round(worker_seconds(metrics_url, "decode") - before, 3)}
    out.append(back)
    log(f"  round {i}: {json.dumps(back)}")
    return out


def table(flips: list[dict[str, Any]]) -> str:
    head = f"{'round':>5}  {'direction':<16} {'streams':>7} {'moved':>5} {'command s':>9} {'gateway s':>9} {'worker s':>8}"
    rows = [head, "-" * len(head)]
    for k, f in enumerate(flips):
        rows.append(f"{k // 2:>5}  {f['direction']:<16} {f['streams']:>7} {f['moved']:>5} {fmt(f['command_s'], 2, 9)} "
                    f"{fmt(f['gateway_s'], 2, 9)} {fmt(f['worker_s'], 2, 8)}")
    return "\n".join(rows)


def summarize(flips: list[dict[str, Any]], args: argparse.Namespace, load: float) -> dict[str, Any]:
    there = [f for f in flips if f["direction"] == "decode->prefill"]
    back = [f for f in flips if f["direction"] == "prefill->decode"]
    p50 = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    worst = max(f["command_s"] for f in there)
    return {"streams": args.streams, "command_s_p50": p50([f["command_s"] for f in there]), "command_s_max": worst,
            "gateway_s_p50": p50([f["gateway_s"] for f in there]), "worker_s_p50": p50([f["worker_s"] for f in there]),
            "back_command_s_p50": p50([f["command_s"] for f in back]),
            "back_gateway_s_p50": p50([f["gateway_s"] for f in back]),
            "moved_streams": sum(f["moved"] for f in there), "lost_streams": sum(f["lost"] for f in there),
            "goal_s": GOAL_S, "meets_goal": worst <= GOAL_S, "load_1m": round(load, 2), "cores": os.cpu_count()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4, help="streams on the worker flipped (twice as many are sent)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--when", type=int, default=3, help="flip once every stream has this many tokens")
    p.add_argument("--drain-seconds", type=float, default=1.0, help="splitserve flip --drain-seconds")
    p.add_argument("--prefills", type=int, default=4, help="long prompts in flight on the flip back to decode")
    p.add_argument("--prefill-lead", type=float, default=0.5, help="s between sending them and the flip")
    p.add_argument("--threshold", type=int, default=96, help="decode.disaggThreshold: the streams stay under it")
    p.add_argument("--device", default="cpu", help="model.device of the three workers (cuda: they share one GPU)")
    p.add_argument("--model", default="smollm2", help="model.name: smollm2 (embedded) or a model directory")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of --model's shape (a directory with config.json and tokenizer files)")
    p.add_argument("--save", default="cpu2", metavar="NAME", help="write benchmarks/results/role_flip_NAME.json, .md")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="role-flip-bench-"))
    config = workdir / "cluster.yaml"
    config.write_text(CLUSTER.format(threshold=args.threshold, device=args.device, model=args.model,
                                     load_format=args.load_format,
                                     dtype="float32" if args.device == "cpu" else "bfloat16"))
    load_start = os.getloadavg()[0]
    log(f"starting splitserve up: 1 prefill + 2 decode workers (load {load_start:.2f})")
    flips: list[dict[str, Any]] = []
    with Cluster(file=config) as c:
        warm_up(c.url)
        for i in range(args.rounds):
            flips += one_round(c, i, args)
    summary = summarize(flips, args, os.getloadavg()[0])
    text = table(flips)
    result = {"args": vars(args), "load_1m_start": round(load_start, 2), "flips": flips, "summary": summary}
    if not args.no_save:
        command = (f"`python benchmarks/role_flip.py --rounds {args.rounds} --streams {args.streams} "
                   f"--max-tokens {args.max_tokens} --drain-seconds {args.drain_seconds} --device {args.device} "
                   f"--load-format {args.load_format}` on "
                   f"{os.cpu_count()} cores "
                   f"(1-min load {load_start:.1f} at the start, {summary['load_1m']} at the end)")
        weights = ", random weights" if args.load_format == "dummy" else ""
        save(f"role_flip_{args.save}", result, report(f"Role flips on {args.device} (SmolLM2{weights})", command, text,
                                                      summary))
    print(text)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
