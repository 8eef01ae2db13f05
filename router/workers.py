"""The gateway's view of its workers: who they are (from membership), whether they are healthy (checked in the
background), and how loaded they are (requests this gateway has in flight on each).

Health is not latency: a worker is marked down when its connection breaks, or after several health checks in a
row failed; one slow answer from a busy worker does not take it out of rotation.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from splitserve.common.membership import Membership, WorkerInfo
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.router.metrics import WORKER_HEALTHY
from splitserve.router.policy import WorkerLoad

log = logging.getLogger("splitserve.router.workers")
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


@dataclass(eq=False)
class Worker:
    info: WorkerInfo
    channel: grpc.aio.Channel = field(repr=False)
    stub: pb_grpc.WorkerStub = field(repr=False)
    load: WorkerLoad = field(repr=False)
    failures: int = 0  # health checks failed in a row

    @property
    def endpoint(self) -> str:
        return self.info.endpoint


class WorkerSet:
    """Workers from membership, with health and load; implements the policies' `WorkerView`."""

    def __init__(self, membership: Membership, interval: float = 1.0, failures_to_down: int = 3) -> None:
        self.membership = membership
        self.interval = interval
        self.failures_to_down = failures_to_down
        self.by_name: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None
        membership.subscribe(self.sync)
        self.sync()

    # -- membership -----------------------------------------------------------------------------------
    def sync(self) -> None:
        """Match the worker set to membership: new workers get a channel, departed ones lose theirs."""
        current = {w.name: w for w in self.membership.workers()}
        for name in list(self.by_name):
            worker = self.by_name[name]
            info = current.get(name)
            if info is None or info.instance_id != worker.info.instance_id or info.endpoint != worker.endpoint:
                del self.by_name[name]
                asyncio.ensure_future(worker.channel.close()) if _loop_running() else None
        for name, info in current.items():
            worker = self.by_name.get(name)
            if worker is None:
                ch = grpc.aio.insecure_channel(info.endpoint, options=GRPC_OPTIONS)
                load = WorkerLoad(name, info.endpoint, info.role, healthy=False, draining=info.draining)
                self.by_name[name] = Worker(info, ch, pb_grpc.WorkerStub(ch), load)
            else:
                worker.info = info
                worker.load.draining = info.draining

    @property
    def workers(self) -> list[Worker]:
        return list(self.by_name.values())

    # -- WorkerView -----------------------------------------------------------------------------------
    def candidates(self, role: str) -> list[WorkerLoad]:
        return [w.load for w in self.by_name.values() if w.load.serves(role) and w.load.available]

    def get(self, name: str) -> Worker | None:
        return self.by_name.get(name)

    # -- health -----------------------------------------------------------------------------------------
    def mark_down(self, worker: Worker, why: str) -> None:
        self._set_health(worker, False, why)

    def _set_health(self, worker: Worker, ok: bool, why: str = "") -> None:
        if ok != worker.load.healthy:
            level = logging.INFO if ok else logging.WARNING
            log.log(level, "worker %s (%s) is %s%s", worker.endpoint, worker.info.role,
                    "healthy" if ok else "unhealthy", f": {why}" if why else "")
        worker.load.healthy = ok
        WORKER_HEALTHY.labels(worker.endpoint, worker.info.role).set(int(ok))

    async def check(self, worker: Worker) -> None:
        try:
            h = await worker.stub.Health(pb.HealthRequest(), timeout=max(1.0, 2 * self.interval))
        except grpc.aio.AioRpcError as e:
            worker.failures += 1
            broken = e.code() == grpc.StatusCode.UNAVAILABLE
            if broken or worker.failures >= self.failures_to_down:
                self._set_health(worker, False, e.details() or e.code().name)
            return
        worker.failures = 0
        role_ok = h.role == worker.info.role or (worker.info.role == "decode" and h.role == "both") or \
            (worker.info.role == "both" and h.role in ("both", "decode"))
        self._set_health(worker, h.live and h.ready and role_ok,
                         "" if role_ok else f"it serves {h.role}, not {worker.info.role}")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def start(self) -> None:
        await self.membership.start()
        self.sync()
        await self.check_all()
        self._task = asyncio.ensure_future(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.membership.close()
        for w in self.workers:
            await w.channel.close()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
