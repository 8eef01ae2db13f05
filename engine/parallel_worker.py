"""The tensor-parallel ranks other than 0: one process per GPU that loads its shard of the model and runs the
steps rank 0 broadcasts. Rank 0 is the engine itself (it schedules and samples); every rank runs the same
forward pass, and the collectives inside it keep them in lockstep.

Rank 0 starts its followers with `start_followers`; they die with it (PR_SET_PDEATHSIG) and stop when told.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time

import torch

from splitserve.common.proc import die_with_parent, free_port
from splitserve.engine.config import EngineConfig
from splitserve.engine.loading import build_runner, rank_device
from splitserve.engine.parallel import ParallelContext, init_parallel
from splitserve.engine.step_batch import receive_step, send_stop

log = logging.getLogger("splitserve.engine.parallel_worker")

def start_followers(config: EngineConfig, device: torch.device) -> tuple[ParallelContext, list[subprocess.Popen]]:
    """Start ranks 1..N-1 and join them as rank 0; fails with the rank's exit code if one dies first."""
    world = config.parallel.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    procs = [
        subprocess.Popen([sys.executable, "-m", "splitserve.engine.parallel_worker", "--rank", str(r),
                          "--world-size", str(world), "--init-method", init_method, "--config", config.to_json()],
                         stdin=subprocess.DEVNULL,
                         preexec_fn=die_with_parent)
        for r in range(1, world)
    ]
    joined: dict[str, object] = {}

    def join() -> None:
        try:
            joined["ctx"] = init_parallel(0, world, init_method, device, config.parallel.expert_parallel)
        except Exception as e:  # surfaced below
            joined["error"] = e

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    while thread.is_alive():
        for r, p in enumerate(procs, start=1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {r} exited with code {p.returncode} before joining")
        thread.join(0.2)
    if "error" in joined:
        raise RuntimeError(f"tensor-parallel group did not form: {joined['error']}")
    return joined["ctx"], procs


def stop_followers(ctx: ParallelContext, procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    try:
        send_stop(ctx)
    except Exception as e:  # a follower already gone: make sure the rest go too
        log.warning("could not tell followers to stop: %s", e)
    # every rank tears its communicators down at the same time (NCCL's teardown waits for the peers)
    closer = threading.Thread(target=ctx.close, daemon=True)
    closer.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    closer.join(max(0.1, deadline - time.monotonic()))
    if closer.is_alive():
        log.warning("tensor-parallel group teardown did not finish in %.0f s", timeout_s)


def follower_main(rank: int, world: int, init_method: str, config: EngineConfig) -> None:
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = init_parallel(rank, world, init_method, device, config.parallel.expert_parallel)
    runner, num_blocks, _ = build_runner(config, device, ctx)
    log.info("rank %d ready: %d kv blocks", rank, num_blocks)
    with torch.inference_mode():
        while (batch := receive_step(ctx, num_blocks)) is not None:
            runner.forward(batch)
    log.info("rank %d stopping", rank)
    runner.graphs = None  # graphs hold the communicators: release them first
    ctx.close()


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: the group is already closed, and a collective library's
    destructor running at exit can abort an otherwise finished process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    from splitserve.common.logs import setup_logging

    ap = argparse.ArgumentParser(prog="splitserve.engine.parallel_worker",
                                 description="a tensor-parallel rank (started by rank 0, not by hand)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = ap.parse_args(argv)
    setup_logging()
    try:
        follower_main(args.rank, args.world_size, args.init_method, EngineConfig.from_json(args.config))
    except Exception as e:
        log.error("rank %d failed: %s", args.rank, e)
        _exit_now(1)
    _exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
