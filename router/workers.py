"""The gateway's view of its workers: who they are (from membership), whether they are healthy (checked in the
background), and how loaded they are (requests this gateway has in flight on each).

Health is not latency. A worker's state is `up` (ready: it gets requests), `starting` (not listening yet, or
answering but not ready), `slow` (still accepts connections, but several health checks in a row went
unanswered) or `down` (its connection broke after it had answered once). One late answer from a busy worker
changes nothing; while a role has workers that are merely slow or starting, requests wait for them (bounded by
the queue timeout) instead of failing. A slow prefill worker stays a prefill candidate: under load a prefill
worker misses health checks because it is busy, not gone, and dropping it would make every decode worker
prefill long prompts itself; the gateway's own backlog accounting steers prompts away from it, and a prefill
that does fail is computed by its decode worker (counted as `fallback`).

A worker that flips its role keeps its name, instance and connection: when membership names it under its new
role, its view changes role in place.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.common.membership import Membership, WorkerInfo
from splitserve.common.worker_client import GrpcWorkerClient
from splitserve.common.worker_messages import WorkerCallError, WorkerClient
from splitserve.router.metrics import HEALTH_FLAPS, WORKER_HEALTHY
from splitserve.router.policy import WorkerLoad

log = logging.getLogger("splitserve.router.workers")
STARTING_CHECK_SECONDS = 0.2  # how often a starting worker's health is asked (the interval, if shorter)


@dataclass(eq=False)
class Worker:
    info: WorkerInfo
    client: WorkerClient = field(repr=False)
    load: WorkerLoad = field(repr=False)
    failures: int = 0  # health checks failed in a row
    state: str = "starting"  # up | starting | slow | down
    reached: bool = False  # it answered a health check once: a refused connection after that means down
    engine: str = ""  # native | vllm, as its health says ("" until it answered)
    capabilities: frozenset[str] = frozenset()  # as its health says: "resume" (it can continue a moved request)
    kv_connector: str = ""  # as its health says (engine vllm, disaggregated): layerwise | push | pull
    kv_transports: dict[str, str] = field(default_factory=dict)  # ... peer -> the transport NIXL uses toward it

    @property
    def endpoint(self) -> str:
        return self.info.endpoint


class WorkerSet:
    """Workers from membership, with health and load; implements the policies' `WorkerView`."""

    def __init__(self, membership: Membership, interval: float = 1.0, failures_to_down: int = 3,
                 connect: Callable[[str], WorkerClient] = GrpcWorkerClient) -> None:
        self.membership = membership
        self.connect = connect  # endpoint -> the client of the worker there
        self.interval = interval
        self.failures_to_down = failures_to_down
        self.by_name: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None
        self._changed: asyncio.Event | None = None  # set (then replaced) whenever a worker's state changes
        self._retiring: list[Worker] = []  # left membership with calls in flight
        self._closing: set[asyncio.Task] = set()
        membership.subscribe(self.sync)
        self.sync()

    # -- membership -----------------------------------------------------------------------------------
    def sync(self) -> None:
        """Match the worker set to membership: new workers get a client, departed ones lose theirs."""
        current = {w.name: w for w in self.membership.workers()}
        for name in list(self.by_name):
            worker = self.by_name[name]
            info = current.get(name)
            if info is None or info.instance_id != worker.info.instance_id or info.endpoint != worker.endpoint:
                del self.by_name[name]
                self._retiring.append(worker)  # its client closes once no call of ours is left on it
        self._close_retired()
        for name, info in current.items():
            worker = self.by_name.get(name)
            if worker is None:
                load = WorkerLoad(name, info.endpoint, info.role, healthy=False, instance_id=info.instance_id)
                worker = self.by_name[name] = Worker(info, self.connect(info.endpoint), load)
                HEALTH_FLAPS.labels(info.endpoint, info.role)  # the series exists from the start
            elif info.role != worker.info.role:
                self._role_changed(worker, info)
            worker.info = info
            load = worker.load
            load.draining = load.draining or info.draining
            load.num_waiting, load.num_running = info.num_waiting, info.num_running
            load.kv_blocks_used, load.kv_capacity_blocks = info.kv_blocks_used, info.kv_capacity_blocks

    def _role_changed(self, worker: Worker, info: WorkerInfo) -> None:
        """A role flip: the worker registered under its new role (it serves it already)."""
        old = worker.info.role
        try:
            WORKER_HEALTHY.remove(worker.endpoint, old)
        except KeyError:
            pass  # never checked under its old role
        HEALTH_FLAPS.labels(info.endpoint, info.role)
        worker.load.role = info.role
        worker.load.draining = info.draining
        WORKER_HEALTHY.labels(worker.endpoint, info.role).set(int(worker.state == "up"))
        log.info("worker %s (%s) now serves %s", worker.endpoint, old, info.role)

    def _close_retired(self) -> None:
        if not _loop_running():
            return
        for worker in [w for w in self._retiring if w.load.outstanding <= 0]:
            self._retiring.remove(worker)
            task = asyncio.get_running_loop().create_task(worker.client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @property
    def workers(self) -> list[Worker]:
        return list(self.by_name.values())

    # -- WorkerView -----------------------------------------------------------------------------------
    def candidates(self, role: str) -> list[WorkerLoad]:
        return [w.load for w in self.by_name.values() if w.load.serves(role)
                and (w.load.available or (role == "prefill" and w.state == "slow" and not w.load.draining))]

    def get(self, name: str) -> Worker | None:
        return self.by_name.get(name)

    def alive(self, role: str) -> bool:
        """Whether some worker of `role` may still take requests: up, starting, or merely slow."""
        return any(w.load.serves(role) and not w.load.draining and w.state != "down" for w in self.by_name.values())

    async def wait_for_change(self, timeout: float) -> None:
        """Until some worker's state changes (or `timeout` seconds pass)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            pass

    # -- health -----------------------------------------------------------------------------------------
    def mark_down(self, worker: Worker, why: str) -> None:
        """A call found the worker's connection broken."""
        self._set_state(worker, "down", why)

    def _set_state(self, worker: Worker, state: str, why: str = "") -> None:
        old = worker.state
        worker.state = state
        worker.load.healthy = state == "up"
        WORKER_HEALTHY.labels(worker.endpoint, worker.info.role).set(int(state == "up"))
        if state == old:
            return
        level = logging.INFO if state in ("up", "starting") or old == "starting" else logging.WARNING
        log.log(level, "worker %s (%s) is %s%s", worker.endpoint, worker.info.role, state, f": {why}" if why else "")
        if old == "up":
            HEALTH_FLAPS.labels(worker.endpoint, worker.info.role).inc()
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def check(self, worker: Worker) -> None:
        try:
            h = await worker.client.health(timeout_s=max(2.0, 2 * self.interval))
        except WorkerCallError as e:
            worker.failures += 1
            why = e.details
            if e.kind == "unavailable" and not worker.reached:  # not listening yet: still starting
                self._set_state(worker, "starting", "not listening yet")
            elif e.kind == "unavailable":  # refused or reset: the connection is broken
                self._set_state(worker, "down", why)
            elif worker.failures >= self.failures_to_down and worker.state == "up":
                self._set_state(worker, "slow", f"{worker.failures} health checks in a row failed: {why}")
            return
        worker.failures = 0
        worker.reached = True
        worker.engine = h.engine
        worker.capabilities = h.capabilities
        worker.kv_connector, worker.kv_transports = h.kv_connector, h.kv_transports
        worker.load.draining = h.draining or worker.info.draining
        role_ok = h.role == worker.info.role or (worker.info.role == "decode" and h.role == "both") or \
            (worker.info.role == "both" and h.role in ("both", "decode"))
        if not role_ok and (h.draining or worker.info.draining):  # a role flip: membership follows in a moment
            self._set_state(worker, "starting", f"changing role: it serves {h.role}, registered as {worker.info.role}")
        elif not role_ok:
            self._set_state(worker, "down", f"it serves {h.role}, not {worker.info.role}")
        elif not h.live:
            self._set_state(worker, "down", "its engine stopped")
        else:
            self._set_state(worker, "up" if h.ready else "starting", "" if h.ready else "not ready")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def _loop(self) -> None:
        while True:
            self.sync()  # registry members' reported load changes without a membership change
            await self.check_all()
            # a worker still starting (loading its model, or taking its new role) is asked more often, so it takes
            # work within a moment of being ready; its check is one call on a near link
            starting = any(w.state == "starting" for w in self.workers)
            await asyncio.sleep(min(self.interval, STARTING_CHECK_SECONDS) if starting else self.interval)

    async def start(self) -> None:
        await self.membership.start()
        self.sync()
        await self.check_all()
        self._task = asyncio.ensure_future(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.membership.close()
        for w in self.workers + self._retiring:
            await w.client.close()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
