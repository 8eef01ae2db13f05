"""Latency of the small all-reduces tensor parallelism issues at decode (one per o_proj and down_proj: two per
layer), over NCCL between 2+ GPUs of one host, eagerly and replayed from a CUDA graph.

Launches one process per GPU itself. Prints a table, then one JSON line; writes it under $OUT or --out.
Keep NCCL_NVLS_ENABLE=0 on shared hosts.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import finish, out_path

SIZES = (1, 8, 32, 128)  # tokens; each row is hidden=4096 bf16 (8 KiB a token)
CALLS = 64  # all-reduces per decode step of a 32-layer model


def _worker(rank: int, world: int, port: int, queue) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    rows = []
    for tokens in SIZES:
        x = torch.ones(tokens, 4096, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        eager = []
        for _ in range(5):
            dist.barrier()
            e0.record()
            for _ in range(CALLS):
                dist.all_reduce(x)
            e1.record()
            torch.cuda.synchronize()
            eager.append(e0.elapsed_time(e1) * 1e3 / CALLS)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                dist.all_reduce(x)
        graphed = []
        for _ in range(5):
            dist.barrier()
            e0.record()
            graph.replay()
            e1.record()
            torch.cuda.synchronize()
            graphed.append(e0.elapsed_time(e1) * 1e3 / CALLS)
        rows.append({"tokens": tokens, "bytes": tokens * 4096 * 2, "eager_us": statistics.median(eager),
                     "graph_us": statistics.median(graphed)})
        del graph
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.distributed_c10d._abort_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_worker, args=(args.gpus, port, queue), nprocs=args.gpus, start_method="spawn")
    rows = queue.get(timeout=60)
    res = {"device": torch.cuda.get_device_name(0), "gpus": args.gpus, "calls_per_step": CALLS, "rows": rows}
    out_path(f"allreduce_latency_{args.gpus}gpu.json", args.out).write_text(json.dumps(res, indent=1) + "\n")
    finish("\n".join(f"all-reduce {r['tokens']:>4} tokens ({r['bytes'] // 1024:>5} KiB): eager {r['eager_us']:6.1f} "
                     f"us, graph {r['graph_us']:6.1f} us; x{CALLS} per step = {r['graph_us'] * CALLS / 1e3:.2f} ms"
                     for r in rows), res)


if __name__ == "__main__":
    main()
