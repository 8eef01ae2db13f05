"""The tensor-parallel ranks other than 0: one process per GPU that loads its shard of the model and runs the
steps rank 0 broadcasts. Rank 0 is the engine itself (it schedules and samples); every rank runs the same
forward pass, and the collectives inside it keep them in lockstep.

Rank 0 starts its followers with `start_followers`; they die with it (PR_SET_PDEATHSIG) and stop when told.
Each follower also gets a `RankLink` to rank 0 and, when the config names one (`parallel.rank_connector`), a
KV connector: the worker side of KV streaming on this rank (its own transfer agent over its own KV shard),
driven by the `rank_plan` of each step and by messages over the link.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from splitserve.common.proc import die_with, free_port, python_module
from splitserve.engine.config import EngineConfig
from splitserve.engine.loading import build_runner, rank_device
from splitserve.engine.parallel import KVShard, ParallelContext, init_parallel, replicate_kv_heads
from splitserve.engine.parallel_link import RankLink
from splitserve.engine.step_batch import KVCopy, receive_step, send_stop

log = logging.getLogger("splitserve.engine.parallel_worker")


@dataclass
class RankContext:
    """What a follower rank's KV connector is built from."""

    shard: KVShard
    device: torch.device
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): [num_blocks, block_size, heads, head_dim]
    link: RankLink  # to rank 0
    extra: dict[str, Any] = field(default_factory=dict)


class RankConnector(Protocol):
    """The worker side of a KV connector on a follower rank. Rank 0's layer hook makes each step's `rank_plan`;
    every follower's connector gets it before the forward pass and, if it returns True, each layer as it is
    written (the step then runs eagerly on every rank alike)."""

    def on_step_begin(self, plan: list[int]) -> bool: ...

    def on_layer_written(self, layer_idx: int) -> None: ...

    def on_step_end(self) -> None: ...

    def close(self) -> None: ...


def load_rank_connector(spec: str) -> Callable[[RankContext], RankConnector]:
    """`module:callable`, imported by name so the engine needs no import of the layers above it."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"parallel.rank_connector must be module:callable, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def start_followers(config: EngineConfig, device: torch.device
                    ) -> tuple[ParallelContext, list[subprocess.Popen], list[RankLink]]:
    """Start ranks 1..N-1 and join them as rank 0; fails with the rank's exit code if one dies first.
    Returns the group, the processes and a link to each follower (index r-1 for rank r)."""
    world = config.parallel.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    procs, links = [], []
    for r in range(1, world):
        ours, theirs = socket.socketpair()
        procs.append(subprocess.Popen(
            [*python_module("splitserve.engine.parallel_worker"), "--rank", str(r), "--world-size", str(world),
             "--init-method", init_method, "--config", config.to_json(), "--link-fd", str(theirs.fileno()),
             "--parent-pid", str(os.getpid())],
            # no preexec_fn: rank 0 runs gRPC threads, and Python between fork and exec can deadlock or abort
            # in the child (gRPC's fork handlers); the follower sets its parent-death signal itself
            stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),)))
        theirs.close()
        links.append(RankLink(ours, f"rank {r}").start())
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
    return joined["ctx"], procs, links


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


def follower_main(rank: int, world: int, init_method: str, config: EngineConfig, link_fd: int | None = None) -> None:
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = init_parallel(rank, world, init_method, device, config.parallel.expert_parallel)
    runner, num_blocks, _ = build_runner(config, device, ctx)
    shard = KVShard.of(runner.arch.num_kv_heads, rank, world)
    connector: RankConnector | None = None
    if link_fd is not None:
        link = RankLink.from_fd(link_fd, "rank 0")
        if config.parallel.rank_connector:
            factory = load_rank_connector(config.parallel.rank_connector)
            connector = factory(RankContext(shard, device, runner.kv_caches, link))
        link.start()
    log.info("rank %d ready: %d kv blocks, kv heads %d..%d", rank, num_blocks, shard.head_start,
             shard.head_start + shard.num_heads - 1)
    try:
        with torch.inference_mode():
            while (msg := receive_step(ctx, num_blocks)) is not None:
                if isinstance(msg, KVCopy):
                    replicate_kv_heads(ctx, runner.kv_caches, msg.block_ids, shard.num_kv_heads)
                    continue
                layered = connector is not None and bool(msg.rank_plan) and connector.on_step_begin(msg.rank_plan)
                runner.forward(msg, connector.on_layer_written if layered else None)
                if layered:
                    connector.on_step_end()
    finally:
        if connector is not None:
            connector.close()
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
    ap.add_argument("--link-fd", type=int, default=None, help="this end of the socket pair to rank 0")
    ap.add_argument("--parent-pid", type=int, default=None, help="rank 0's pid: exit when it dies")
    args = ap.parse_args(argv)
    if args.parent_pid is not None:
        die_with(args.parent_pid)
    setup_logging()
    try:
        follower_main(args.rank, args.world_size, args.init_method, EngineConfig.from_json(args.config),
                      args.link_fd)
    except Exception as e:
        log.error("rank %d failed: %s", args.rank, e)
        _exit_now(1)
    _exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
