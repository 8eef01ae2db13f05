"""KV transfer between two processes: bandwidth and per-request latency, whole-request vs layer-wise.

Cases: (a) SmolLM2's KV for a 2k-token prompt, (b) a Llama-3.1-8B-shaped KV for 3k tokens (32 layers x 8 KV
heads x 128 dims, bf16, ~403 MB). Modes:
  whole      every layer in one transfer (the KV is already computed)
  layerwise  one `send_layer` per layer, back to back (NIXL: a write per layer, one notice per request)
  paced      layers released at a fixed interval (as prefill compute would), measuring the tail: how long
             after the sender's last layer is written the receiver has everything
On CUDA the sender uses GPU 0 and the receiver GPU 1 (or GPU 0 when only one exists), and `copy_gbps` is a
device-to-device torch copy over the same pair, measured in the same run. Prints a table, then one JSON line.
With NIXL each case also reports the write requests (`*_xfers`), descriptors (`*_descs`) and notices
(`*_notifs`) the sender made per request; `--chunk-bytes a,b,c` reruns the layer-wise case with each
descriptor size (`nixl_backend.CHUNK_BYTES`) and reports those under `chunk_sweep`. `--layer-groups 1,4,8` reruns
the layer-wise and paced cases with each number of layers a write (`send_session.LAYER_GROUP`) and reports those
under `layer_group_sweep`; the main row is always one layer a write.

The receiver is this script again in a child process (`--receiver`), talking JSON lines over its stdin/stdout.
The parent watches it while waiting for any reply: a receiver that dies (NIXL missing, out of memory) is
reported within a fraction of a second, with its exit code and last stderr lines, instead of waited on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import torch
from harness import finish, rounded

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


def _verified(digest: float, expected: float) -> bool:
    return abs(digest - expected) <= 1e-6 * max(1.0, abs(expected))


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
        if msg.get("verify"):  # zeros first, so the digest sees this request's bytes, not an earlier one's
            for pair in kv:
                for t in pair:
                    t[blocks] = 0
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


def run_case(backend: str, device: str, recv_device: str, case: str, reps: int, chunks: list[int],
             groups: list[int]) -> dict:
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
            with _layer_group(1):  # the main row and the chunk sweep: one layer a write
                out = _measure(receiver, agent, kv, case, nbytes, reps)
                if chunks:
                    out["chunk_sweep"] = _sweep(receiver, agent, kv, case, nbytes, reps, chunks)
            if groups != [1]:
                out["layer_group_sweep"] = _group_sweep(receiver, agent, kv, case, nbytes, reps, groups,
                                                        out["paced_interval_ms"] / 1e3)
            return out
        finally:
            agent.close()
    finally:
        receiver.close()


def _counts(agent: KVTransferAgent) -> dict:
    """The sender's NIXL counters so far (empty for TCP)."""
    return dict(getattr(agent.backend, "counts", {}))


def _one(receiver: Receiver, agent: KVTransferAgent, layers: int, src: list[int], rid: str, mode: str,
         interval: float = 0.0, verify: bool = False) -> dict:
    """One request: seconds to the receiver's completion from the first send, and from the last layer's send;
    the receiver's digest when `verify`; the sender's NIXL counts for it."""
    from splitserve.kv_transfer import TransferTicket

    receiver.send_json({"op": "expect", "rid": rid, "verify": verify})
    ticket = TransferTicket.decode(receiver.recv_json(REPLY_S)["ticket"].encode())
    before = _counts(agent)
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
    after = _counts(agent)
    counts = {k: after[k] - before.get(k, 0) for k in ("xfers", "descs", "notifs") if k in after}
    return {"total": res["done"] - t0, "tail": res["done"] - last_written, "digest": res["digest"], **counts}


def _sweep(receiver: Receiver, agent: KVTransferAgent, kv, case: str, nbytes: int, reps: int,
           chunks: list[int]) -> list[dict]:
    """The layer-wise case again per descriptor size (bytes), each checked bit for bit first."""
    from splitserve.kv_transfer import nixl_backend

    layers, nblocks = len(kv), CASES[case][3] // BLOCK
    src = list(range(2, 2 + nblocks))
    expected = _digest(kv, src)
    default, out = nixl_backend.CHUNK_BYTES, []
    try:
        for chunk in chunks:
            nixl_backend.CHUNK_BYTES = chunk  # read when a request opens its channels
            digest = _one(receiver, agent, layers, src, f"{case}-sweep{chunk}-check", "layerwise", verify=True)["digest"]
            runs = [_one(receiver, agent, layers, src, f"{case}-sweep{chunk}-{i}", "layerwise") for i in range(reps)]
            t = statistics.median(r["total"] for r in runs)
            out.append({"chunk_bytes": chunk, "layerwise_ms": t * 1e3, "layerwise_gbps": nbytes / t / 1e9,
                        "verified": _verified(digest, expected),
                        **{k: runs[-1][k] for k in ("xfers", "descs", "notifs")}})
    finally:
        nixl_backend.CHUNK_BYTES = default
    return out


@contextlib.contextmanager
def _layer_group(group: int):
    """Sessions begun inside write `group` consecutive layers at a time (`send_session.LAYER_GROUP`)."""
    from splitserve.kv_transfer import send_session

    default, send_session.LAYER_GROUP = send_session.LAYER_GROUP, group
    try:
        yield
    finally:
        send_session.LAYER_GROUP = default


def _group_sweep(receiver: Receiver, agent: KVTransferAgent, kv, case: str, nbytes: int, reps: int,
                 groups: list[int], interval: float) -> list[dict]:
    """The layer-wise case again per layer group, each checked bit for bit first, and the paced case's tail with
    layers released every `interval` seconds (the main row's)."""
    layers, nblocks = len(kv), CASES[case][3] // BLOCK
    src = list(range(2, 2 + nblocks))
    expected = _digest(kv, src)
    out = []
    for group in groups:
        with _layer_group(group):
            rid = f"{case}-group{group}"
            digest = _one(receiver, agent, layers, src, f"{rid}-check", "layerwise", verify=True)["digest"]
            runs = [_one(receiver, agent, layers, src, f"{rid}-{i}", "layerwise") for i in range(reps)]
            tails = [_one(receiver, agent, layers, src, f"{rid}-paced-{i}", "paced", interval)["tail"]
                     for i in range(reps)]
        t = statistics.median(r["total"] for r in runs)
        out.append({"layer_group": group, "layerwise_ms": t * 1e3, "layerwise_gbps": nbytes / t / 1e9,
                    "tail_after_last_layer_ms": statistics.median(tails) * 1e3,
                    "verified": _verified(digest, expected),
                    **{k: runs[-1][k] for k in ("xfers", "descs", "notifs") if k in runs[-1]}})
    return out


def _measure(receiver: Receiver, agent: KVTransferAgent, kv, case: str, nbytes: int, reps: int) -> dict:
    layers, nblocks = len(kv), CASES[case][3] // BLOCK
    src = list(range(2, 2 + nblocks))
    counter = iter(range(10**6))

    def one(mode, interval=0.0, verify=False):
        return _one(receiver, agent, layers, src, f"{case}-{mode}-{next(counter)}", mode, interval, verify)

    out = {"name": case, "bytes": nbytes}
    one("whole")  # warm-up: connections, remote-agent handshake
    digest = one("whole", verify=True)["digest"]
    expected = _digest(kv, src)
    out["verified"] = _verified(digest, expected)
    whole = [one("whole") for _ in range(reps)]
    lw = [one("layerwise") for _ in range(reps)]
    whole_s = statistics.median(r["total"] for r in whole)
    lw_s = statistics.median(r["total"] for r in lw)
    out["whole_ms"] = whole_s * 1e3
    out["layerwise_ms"] = lw_s * 1e3
    out["whole_gbps"] = nbytes / whole_s / 1e9
    out["layerwise_gbps"] = nbytes / lw_s / 1e9
    for mode, runs in (("whole", whole), ("layerwise", lw)):  # per request (the same for every rep)
        out.update({f"{mode}_{k}": runs[-1][k] for k in ("xfers", "descs", "notifs") if k in runs[-1]})
    per_layer = lw_s / layers
    interval = 1.5 * per_layer  # compute slower than the link: transfer can hide behind it
    tails = [one("paced", interval)["tail"] for _ in range(reps)]
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
    ap.add_argument("--chunk-bytes", default="",
                    help="NIXL: comma-separated descriptor sizes in bytes (0: runs not cut); reruns the layer-wise "
                         "case with each")
    ap.add_argument("--layer-groups", default="1",
                    help="comma-separated layers a write (send_session.LAYER_GROUP); other than 1: reruns the "
                         "layer-wise and paced cases with each")
    args = ap.parse_args()
    try:
        chunks = [int(c) for c in args.chunk_bytes.split(",") if c.strip()]
    except ValueError:
        sys.exit(f"kv_transfer benchmark: --chunk-bytes takes integers, got {args.chunk_bytes!r}")
    try:
        groups = [int(g) for g in args.layer_groups.split(",") if g.strip()]
    except ValueError:
        sys.exit(f"kv_transfer benchmark: --layer-groups takes integers, got {args.layer_groups!r}")
    if not groups or any(g < 1 for g in groups):
        sys.exit("kv_transfer benchmark: --layer-groups takes integers >= 1")
    if any(c < 0 for c in chunks) or (chunks and args.backend != "nixl"):
        sys.exit("kv_transfer benchmark: --chunk-bytes takes sizes >= 0 and needs --backend nixl")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("kv_transfer benchmark: --device cuda but no GPU is visible")
    send_dev = recv_dev = "cpu"
    copy_gbps = None
    if args.device == "cuda":
        send_dev = "cuda:0"
        recv_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        copy_gbps = copy_bandwidth(send_dev, recv_dev)
    try:
        cases = [run_case(args.backend, send_dev, recv_dev, c, args.reps, chunks, groups)
                 for c in args.cases.split(",")]
    except ChildDied as e:
        sys.exit(f"kv_transfer benchmark: {e}")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    text = f"backend={args.backend} device={args.device} sender={send_dev} receiver={recv_dev} gpu={gpu} " \
           f"copy_gbps={copy_gbps and round(copy_gbps, 1)}\n" + table(cases)
    finish(text, {"backend": args.backend, "device": args.device, "gpu": gpu, "copy_gbps": copy_gbps,
                  "sender": send_dev, "receiver": recv_dev, "cases": [rounded(c) for c in cases]})


def table(cases: list[dict]) -> str:
    lines = [f"{'case':<12}{'MB':>8}{'whole ms':>10}{'GB/s':>8}{'layerw ms':>11}{'GB/s':>8}{'tail ms':>9}"
             f"{'layer ms':>10}{'ok':>5}"]
    for c in cases:
        lines.append(f"{c['name']:<12}{c['bytes'] / 1e6:>8.1f}{c['whole_ms']:>10.2f}{c['whole_gbps']:>8.2f}"
                     f"{c['layerwise_ms']:>11.2f}{c['layerwise_gbps']:>8.2f}{c['tail_after_last_layer_ms']:>9.2f}"
                     f"{c['layer_transfer_ms']:>10.2f}{str(c['verified']):>5}")
        if "layerwise_descs" in c:
            lines.append(f"{'':<12}per request: whole {c['whole_xfers']} writes / {c['whole_descs']} descriptors, "
                         f"layer-wise {c['layerwise_xfers']} writes / {c['layerwise_descs']} descriptors / "
                         f"{c['layerwise_notifs']} notices")
        for sw in c.get("chunk_sweep", ()):
            lines.append(f"{'':<12}chunk {sw['chunk_bytes']:>9} B: layer-wise {sw['layerwise_ms']:.2f} ms "
                         f"{sw['layerwise_gbps']:.2f} GB/s, {sw['descs']} descriptors, ok={sw['verified']}")
        for sw in c.get("layer_group_sweep", ()):
            writes = f", {sw['xfers']} writes" if "xfers" in sw else ""
            lines.append(f"{'':<12}layer group {sw['layer_group']:>3}: layer-wise {sw['layerwise_ms']:.2f} ms "
                         f"{sw['layerwise_gbps']:.2f} GB/s, tail {sw['tail_after_last_layer_ms']:.2f} ms{writes}, "
                         f"ok={sw['verified']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
