"""KV transfer between two processes: bandwidth and per-request latency, whole-request vs layer-wise.

Cases: (a) SmolLM2's KV for a 2k-token prompt, (b) a Llama-3.1-8B-shaped KV for 3k tokens (32 layers x 8 KV
heads x 128 dims, bf16, ~403 MB). Modes:
  whole      every layer in one transfer (the KV is already computed)
  layerwise  one transfer + one completion notice per layer, back to back
  paced      layers released at a fixed interval (as prefill compute would), measuring the tail: how long
             after the sender's last layer is written the receiver has everything
On CUDA the sender uses GPU 0 and the receiver GPU 1 (or GPU 0 when only one exists), and `copy_gbps` is a
device-to-device torch copy over the same pair, measured in the same run. Prints a table, then one JSON line.

The receiver is this script again in a child process (`--receiver`), talking JSON lines over its stdin/stdout.
The parent watches it while waiting for any reply: a receiver that dies (NIXL missing, out of memory) is
reported within a fraction of a second, with its exit code and last stderr lines, instead of waited on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import torch

from splitserve.common.proc import ChildDied, JsonLinesChild

if TYPE_CHECKING:
    from splitserve.kv_transfer import KVTransferAgent

CASES = {
    # name: (layers, kv_heads, head_dim, tokens, dtype on cpu, dtype on cuda)
    "smollm2_2k": (30, 3, 64, 2048, torch.float32, torch.bfloat16),
    "llama8b_3k": (32, 8, 128, 3072, torch.bfloat16, torch.bfloat16),
    # the same bytes as llama8b_3k in one layer: 2 descriptors instead of 64 (isolates per-descriptor cost)
    "one_layer_403mb": (1, 8, 128, 98304, torch.bfloat16, torch.bfloat16),
}
BLOCK = 16
START_S = 300.0  # seconds the receiver may take to start (torch import, KV allocation, NIXL init)
REPLY_S = 300.0  # seconds to wait for any later reply (a transfer's own deadline is 120 s)


def _kv(layers, heads, dim, blocks, dtype, device, fill):
    shape = (blocks, BLOCK, heads, dim)
    make = (lambda: torch.randn(shape, device=device).to(dtype)) if fill else (lambda: torch.zeros(shape, dtype=dtype, device=device))
    return [(make(), make()) for _ in range(layers)]


def _digest(kv, blocks) -> float:
    return float(sum(t[blocks].float().sum().item() for pair in kv for t in pair))


def receiver_main(backend: str, device: str, case: str) -> None:
    """The child: one JSON line per command on stdin, one reply line per command on the original stdout."""
    from splitserve.kv_transfer import KVLayout, make_agent

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of libraries (NIXL, UCX) go to stderr, never into the replies
    layers, heads, dim, tokens, cpu_dt, cuda_dt = CASES[case]
    dtype = cuda_dt if device.startswith("cuda") else cpu_dt
    nblocks = tokens // BLOCK
    kv = _kv(layers, heads, dim, nblocks + 8, dtype, device, fill=False)
    agent = make_agent(backend, KVLayout(kv))
    print(json.dumps({"ready": agent.backend.name}), file=replies)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "stop":
            break
        blocks = list(range(4, 4 + nblocks))
        ticket = agent.expect(msg["rid"], blocks, timeout_s=120)
        print(json.dumps({"ticket": ticket.encode().decode()}), file=replies)
        agent.wait_blocking(msg["rid"])
        done = time.monotonic()  # CLOCK_MONOTONIC: comparable with the parent's clock on one host
        agent.forget(msg["rid"])
        digest = _digest(kv, blocks) if msg.get("verify") else None
        print(json.dumps({"done": done, "digest": digest}), file=replies)
    agent.close()


class Receiver(JsonLinesChild):
    """Handle on the receiver process (its stderr passed through to ours); every wait for a reply also watches
    the process, so a receiver that dies is reported at once."""

    def __init__(self, backend: str, device: str, case: str) -> None:
        super().__init__([sys.executable, os.path.abspath(__file__), "--receiver", backend, device, case],
                         "receiver", echo_stderr=True)
        ready = self.recv_json(START_S)
        if ready.get("ready") != backend:
            raise ChildDied(f"receiver started backend {ready.get('ready')!r}, not {backend!r}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send_json({"op": "stop"})
                self.proc.wait(30)
            except (ChildDied, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


def run_case(backend: str, device: str, recv_device: str, case: str, reps: int) -> dict:
    from splitserve.kv_transfer import KVLayout, make_agent

    layers, heads, dim, tokens, cpu_dt, cuda_dt = CASES[case]
    dtype = cuda_dt if device.startswith("cuda") else cpu_dt
    nblocks = tokens // BLOCK
    kv = _kv(layers, heads, dim, nblocks + 8, dtype, device, fill=True)
    nbytes = 2 * layers * nblocks * BLOCK * heads * dim * kv[0][0].element_size()
    receiver = Receiver(backend, recv_device, case)
    try:
        agent = make_agent(backend, KVLayout(kv))
        try:
            return _measure(receiver, agent, kv, case, nbytes, reps)
        finally:
            agent.close()
    finally:
        receiver.close()


def _measure(receiver: Receiver, agent: KVTransferAgent, kv, case: str, nbytes: int, reps: int) -> dict:
    from splitserve.kv_transfer import TransferTicket

    layers, nblocks = len(kv), CASES[case][3] // BLOCK
    src = list(range(2, 2 + nblocks))
    counter = iter(range(10**6))

    def one(mode, interval=0.0, verify=False):
        rid = f"{case}-{mode}-{next(counter)}"
        receiver.send_json({"op": "expect", "rid": rid, "verify": verify})
        ticket = TransferTicket.decode(receiver.recv_json(REPLY_S)["ticket"].encode())
        t0 = time.monotonic()
        session = agent.begin(ticket, src)
        last_written = t0
        if mode == "whole":
            session.send_all()
        else:
            for layer in range(layers):
                if interval:
                    time.sleep(max(0.0, t0 + (layer + 1) * interval - time.monotonic()))  # "compute" layer i
                last_written = time.monotonic()
                session.send_layer(layer)
        session.finish()
        res = receiver.recv_json(REPLY_S)
        return res["done"] - t0, res["done"] - last_written, res["digest"]

    out = {"name": case, "bytes": nbytes}
    one("whole")  # warm-up: connections, remote-agent handshake
    _, _, digest = one("whole", verify=True)
    expected = _digest(kv, src)
    out["verified"] = abs(digest - expected) <= 1e-6 * max(1.0, abs(expected))
    whole = [one("whole")[0] for _ in range(reps)]
    lw = [one("layerwise")[0] for _ in range(reps)]
    out["whole_ms"] = statistics.median(whole) * 1e3
    out["layerwise_ms"] = statistics.median(lw) * 1e3
    out["whole_gbps"] = nbytes / statistics.median(whole) / 1e9
    out["layerwise_gbps"] = nbytes / statistics.median(lw) / 1e9
    per_layer = statistics.median(lw) / layers
    interval = 1.5 * per_layer  # compute slower than the link: transfer can hide behind it
    tails = [one("paced", interval)[1] for _ in range(reps)]
    out["layer_transfer_ms"] = per_layer * 1e3
    out["paced_interval_ms"] = interval * 1e3
    out["tail_after_last_layer_ms"] = statistics.median(tails) * 1e3
    return out


def copy_bandwidth(src_dev, dst_dev, nbytes=1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=src_dev).random_()
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    if sys.argv[1:2] == ["--receiver"]:  # the child side: --receiver BACKEND DEVICE CASE
        receiver_main(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["tcp", "nixl"], required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--cases", default="smollm2_2k,llama8b_3k")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("kv_transfer benchmark: --device cuda but no GPU is visible")
    send_dev = recv_dev = "cpu"
    copy_gbps = None
    if args.device == "cuda":
        send_dev = "cuda:0"
        recv_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        copy_gbps = copy_bandwidth(send_dev, recv_dev)
    try:
        cases = [run_case(args.backend, send_dev, recv_dev, c, args.reps) for c in args.cases.split(",")]
    except ChildDied as e:
        sys.exit(f"kv_transfer benchmark: {e}")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    print(f"backend={args.backend} device={args.device} sender={send_dev} receiver={recv_dev} gpu={gpu} "
          f"copy_gbps={copy_gbps and round(copy_gbps, 1)}")
    print(f"{'case':<12}{'MB':>8}{'whole ms':>10}{'GB/s':>8}{'layerw ms':>11}{'GB/s':>8}{'tail ms':>9}"
          f"{'layer ms':>10}{'ok':>5}")
    for c in cases:
        print(f"{c['name']:<12}{c['bytes'] / 1e6:>8.1f}{c['whole_ms']:>10.2f}{c['whole_gbps']:>8.2f}"
              f"{c['layerwise_ms']:>11.2f}{c['layerwise_gbps']:>8.2f}{c['tail_after_last_layer_ms']:>9.2f}"
              f"{c['layer_transfer_ms']:>10.2f}{str(c['verified']):>5}")
    print(json.dumps({"backend": args.backend, "device": args.device, "gpu": gpu, "copy_gbps": copy_gbps,
                      "sender": send_dev, "receiver": recv_dev,
                      "cases": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()} for c in cases]}))


if __name__ == "__main__":
    main()
