"""The gateway's worker states at a cluster's start and after a death, over real gRPC on loopback: a worker that
has never answered is `starting` (quietly: the gateway starts before its workers bind), one that answered once
and then refuses connections is `down` (with a warning)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from splitserve.common.membership import StaticMembership
from splitserve.common.proc import free_port
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.router.workers import WorkerSet


class HealthOnly(pb_grpc.WorkerServicer):
    async def Health(self, request, context):  # noqa: N802 (gRPC's name)
        return pb.HealthResponse(live=True, ready=True, role="decode", engine="native")


async def _serve(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(HealthOnly(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


@pytest.mark.asyncio
async def test_a_worker_not_listening_yet_is_starting_and_one_that_died_is_down(caplog):
    port = free_port()
    workers = WorkerSet(StaticMembership(prefill=[], decode=[f"127.0.0.1:{port}"]))
    (worker,) = workers.workers
    caplog.set_level(logging.INFO, logger="splitserve.router.workers")

    for _ in range(3):  # nothing listens on the port yet
        await workers.check(worker)
    assert worker.state == "starting" and workers.alive("decode")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text

    server = await _serve(port)
    try:
        await _until(workers, worker, "up")  # the channel reconnects after its backoff
    finally:
        await server.stop(None)
    await _until(workers, worker, "down")
    down = [r for r in caplog.records if "is down" in r.getMessage()]
    assert down and down[0].levelno == logging.WARNING
    await worker.client.close()


async def _until(workers: WorkerSet, worker, state: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while worker.state != state:
        assert loop.time() < deadline, f"still {worker.state}, not {state}"
        await workers.check(worker)
        await asyncio.sleep(0.1)
