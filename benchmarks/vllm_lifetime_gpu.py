"""A worker's vLLM server dies with the worker, on a GPU host: a stand-in worker (a process with threads) starts
the real server through `VllmServer` (under its group-leading shim), is killed with SIGKILL 12 s into the
server's start and, again, once the server serves; every process of the server's group (the shim, the API
server, vLLM's engine core and resource tracker) must be gone, and no GPU process left.

  python3 benchmarks/vllm_lifetime_gpu.py MODEL_DIR OUT_DIR   (MODEL_DIR: a config and tokenizer; dummy weights)
-> OUT_DIR/vllm_lifetime.json, a table and a last JSON line (results/vllm_lifetime_h200.json: one H200,
vLLM 0.26.0, SmolLM2's config).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from splitserve.common.proc import group_members

if len(sys.argv) != 3 or not os.path.isdir(sys.argv[1]):
    raise SystemExit("usage: python3 benchmarks/vllm_lifetime_gpu.py MODEL_DIR OUT_DIR (MODEL_DIR: a model's config "
                     "and tokenizer)")
model, out_dir = sys.argv[1], sys.argv[2]
os.makedirs(out_dir, exist_ok=True)
WORKER = textwrap.dedent("""
    import sys, threading, time
    from splitserve.vllm_engine.server import VllmServer
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    model, port, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--load-format", "dummy",
           "--port", port, "--host", "127.0.0.1", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"]
    if mode == "healthy":
        cmd.append("--enforce-eager")
    s = VllmServer(cmd, {}, "http://127.0.0.1:" + port, startup_s=600)
    s.start()
    print(s.proc.pid, flush=True)
    if mode == "healthy":
        s.wait_healthy()
        print("healthy", flush=True)
    time.sleep(3600)
""")


def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmd(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:100]
    except OSError:
        return ""


results = {}
for mode, port, wait in (("loading", "18555", 12.0), ("healthy", "18556", None)):
    err = open(os.path.join(out_dir, f"worker_{mode}.log"), "w")  # the worker's stderr, for its whole life
    w = subprocess.Popen([sys.executable, "-c", WORKER, model, port, mode], stdout=subprocess.PIPE, stderr=err,
                         text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    shim = int(w.stdout.readline())
    t0 = time.monotonic()
    if wait is None:
        line = w.stdout.readline().strip()
        assert line == "healthy", line
        started = time.monotonic() - t0
    else:
        time.sleep(wait)
        started = None
    pids = group_members(shim)
    procs = {p: cmd(p) for p in pids}
    t1 = time.monotonic()
    w.send_signal(signal.SIGKILL)
    w.wait()
    while any(alive(p) for p in pids) and time.monotonic() - t1 < 120:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    results[mode] = {"start_s": started, "group_before_kill": procs, "gone_after_s": round(time.monotonic() - t1, 1),
                     "left": {p: cmd(p) for p in left}}
    print(mode, json.dumps(results[mode]), flush=True)
    for p in left:
        os.kill(p, signal.SIGKILL)
smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout
results["gpu_processes_after"] = smi.strip()
print("| killed | server start s | processes in its group | all gone after s | left |")
print("|---|---|---|---|---|")
for mode in ("loading", "healthy"):
    r = results[mode]
    print(f"| {mode} | {r['start_s'] or '-'} | {len(r['group_before_kill'])} | {r['gone_after_s']} | {len(r['left'])} |")
with open(os.path.join(out_dir, "vllm_lifetime.json"), "w") as f:
    json.dump(results, f, indent=1)
print(json.dumps(results))
