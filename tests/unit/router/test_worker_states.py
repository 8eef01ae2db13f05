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


class Silent(pb_grpc.WorkerServicer):
    """Answers health as `role` until `mute` is set, then never (a worker busy past every health check)."""

    def __init__(self, role: str) -> None:
        self.role, self.mute = role, asyncio.Event()

    async def Health(self, request, context):  # noqa: N802 (gRPC's name)
        if self.mute.is_set():
            await asyncio.sleep(3600)
        return pb.HealthResponse(live=True, ready=True, role=self.role, engine="native")


@pytest.mark.asyncio
async def test_a_busy_prefill_worker_that_misses_health_checks_stays_a_prefill_candidate():
    """`slow` takes a decode worker out of routing, but a prefill worker that misses health checks is busy: were
    it dropped, every decode worker would prefill long prompts itself (no prefill worker named)."""
    ports = {"prefill": free_port(), "decode": free_port()}
    servicers = {role: Silent(role) for role in ports}
    servers = []
    for role, port in ports.items():
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(servicers[role], server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
    workers = WorkerSet(StaticMembership(prefill=[f"127.0.0.1:{ports['prefill']}"],
                                         decode=[f"127.0.0.1:{ports['decode']}"]), interval=0.1, failures_to_down=2)
    try:
        for w in workers.workers:
            await _until(workers, w, "up")
        assert len(workers.candidates("prefill")) == len(workers.candidates("decode")) == 1
        for s in servicers.values():
            s.mute.set()
        for w in workers.workers:
            await _until(workers, w, "slow")
        prefill = next(w for w in workers.workers if w.info.role == "prefill")
        assert [w.name for w in workers.candidates("prefill")] == [prefill.load.name]
        assert workers.candidates("decode") == []  # a slow decode worker is waited for, not routed to
        prefill.load.draining = True
        assert workers.candidates("prefill") == []  # a draining one never is
    finally:
        for w in workers.workers:
            await w.client.close()
        for server in servers:
            await server.stop(None)
