"""The workers a gateway routes to: static endpoints, health tracked in the background, least-loaded pick."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from splitserve.metrics import WORKER_HEALTHY
from splitserve.protocol import splitserve_pb2 as pb
from splitserve.protocol import splitserve_pb2_grpc as pb_grpc

log = logging.getLogger("splitserve.router.pool")
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


@dataclass(eq=False)
class Worker:
    endpoint: str  # host:port; also the name decode workers know their prefill peers by
    role: str  # prefill | decode
    stub: pb_grpc.WorkerStub = field(repr=False)
    healthy: bool = False
    outstanding: int = 0


class WorkerPool:
    def __init__(self, decode: list[str], prefill: list[str], interval: float = 1.0) -> None:
        self.interval = interval
        self._channels = []
        self.workers: list[Worker] = []
        for role, endpoints in (("decode", decode), ("prefill", prefill)):
            for ep in endpoints:
                ch = grpc.aio.insecure_channel(ep, options=GRPC_OPTIONS)
                self._channels.append(ch)
                self.workers.append(Worker(ep, role, pb_grpc.WorkerStub(ch)))
        self._task: asyncio.Task | None = None

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def pick(self, role: str) -> Worker | None:
        """The healthy worker of `role` with the fewest requests outstanding from this gateway."""
        live = [w for w in self.workers if w.role == role and w.healthy]
        return min(live, key=lambda w: w.outstanding) if live else None

    def mark_down(self, worker: Worker) -> None:
        if worker.healthy:
            log.warning("worker %s (%s) marked unhealthy", worker.endpoint, worker.role)
        worker.healthy = False
        WORKER_HEALTHY.labels(worker.endpoint, worker.role).set(0)

    async def check(self, worker: Worker) -> None:
        try:
            h = await worker.stub.Health(pb.HealthRequest(), timeout=max(0.5, self.interval))
            ok = h.live and h.ready and (h.role == worker.role or h.role == "both")
        except grpc.aio.AioRpcError:
            ok = False
        if ok != worker.healthy:
            log.info("worker %s (%s) is %s", worker.endpoint, worker.role, "healthy" if ok else "unhealthy")
        worker.healthy = ok
        WORKER_HEALTHY.labels(worker.endpoint, worker.role).set(int(ok))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for ch in self._channels:
            await ch.close()
