"""The transfer agent: receiver bookkeeping (tickets, per-layer progress, deadlines), and the sender thread its
send sessions (`send_session.SendSession`) write on.

The backend moves bytes; this module decides what is expected, what is done and what failed. Every pending
transfer ends in exactly one of: done, TransferTimeout, TransferError, TransferCancelled — and is then
forgotten, so nothing stays reserved here.

A transfer that ended before every byte landed may still have writes under way; `quiet(request_id)` says when
none can land any more, so its blocks can be freed. A backend that writes on the receiver's side (tcp) counts
its frames in progress (`begin_write` / `end_write`): quiet once the last one ends (no new frame is taken after
the end). A one-sided backend (nixl: the sender writes our memory) reports each sender's word that it stopped
(`sender_stopped`: its abort notice, or its request notice after every write completed): quiet once every
sender said so, or at the ticket's deadline, after which no sender posts a write.

One agent serves one rank's KV shard (`KVLayout.shard`). As a receiver it counts, per layer, the final K and V
writes of every sender routed to it (`Route.num_src`: several prefill ranks write into one decode rank when
the prefill worker has the larger tensor-parallel size). As a sender it writes only its own routes
(`shards.plan_routes`), one channel per receiving rank. Workers with several ranks compose agents in
`sharded.py`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.common.latch import Latch
from splitserve.kv_transfer import metrics
from splitserve.kv_transfer.errors import (
    MalformedTicket,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.send_session import SendSession
from splitserve.kv_transfer.shards import Route, plan_routes
from splitserve.kv_transfer.ticket import RankEndpoint, TransferTicket

log = logging.getLogger("splitserve.kv_transfer")

SEND_POLL_S = 0.0002  # seconds between polls of in-flight writes by the sender thread (none: it blocks)
REAP_S = 0.02  # seconds between deadline checks while transfers are pending (none pending: the reaper blocks)


class Channel(Protocol):
    """Sender side of one transfer to one receiving rank along one `Route`: write runs (src_block, dst_block, n)
    of one layer's K and V, the route's heads only."""

    def write_layer(self, layer: int, runs: list[tuple[int, int, int]], final: bool) -> int: ...

    def write_layers(self, layers: range, runs: list[tuple[int, int, int]], final: bool) -> int:
        """`write_layer` of each of `layers` (consecutive), in as few writes as the backend can."""

    def write_all(self, runs: list[tuple[int, int, int]]) -> int: ...

    def flush(self) -> None: ...

    def poll(self) -> bool | None:
        """Progress in-flight writes; truthy while some remain (synchronous channels: None)."""

    def abort(self) -> None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str
    one_sided: bool  # senders write our memory directly (we see notices, not writes)

    def start(self, agent: KVTransferAgent) -> None: ...

    def endpoint_fields(self) -> dict:
        """This agent's part of a `RankEndpoint` (tcp: endpoint; nixl: metadata, regions)."""

    def open_channel(self, ticket: TransferTicket, route: Route) -> Channel: ...

    def close(self) -> None: ...


@dataclass
class Expected:
    """What a receiving rank accepts for one request (backends check every write against it)."""

    request_id: str
    num_layers: int
    block_ids: list[int]
    skip_blocks: int
    deadline: float  # unix time


@dataclass
class _Pending:
    ticket: Expected
    created: float
    # layer -> {(sender rank, 0 K / 1 V)} whose final write landed; the layer is done with 2 * num_src of them
    final_parts: dict[int, set[tuple[int, int]]] = field(default_factory=dict)
    num_src: int = 0  # senders routed to this rank (0: not known yet, from the first write)
    layers_done: set[int] = field(default_factory=set)
    bytes: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: TransferError | None = None
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)
    writing: int = 0  # frames being written into its blocks on our side right now (receiver-side backends)
    stopped: int = 0  # senders that said they stopped writing (one-sided backends)
    quiet: Latch = field(default_factory=Latch)  # set once no write of it can land any more


class KVTransferAgent:
    def __init__(self, layout: KVLayout, backend: Backend, name: str | None = None) -> None:
        self.layout = layout
        self.backend = backend
        self.name = name or f"splitserve-{uuid.uuid4().hex[:12]}"
        # called (on whichever thread ended it) with each expected transfer's outcome: (request id, error)
        self.on_finish: Callable[[str, TransferError | None], None] | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._expected = threading.Condition(self._lock)  # notified by expect(): wakes idle pollers
        # outcomes kept briefly so a waiter arriving after the end still learns it (bounded)
        self._finished: OrderedDict[str, _Pending] = OrderedDict()
        # transfers that ended before they landed and may still be written (kept apart: `forget` keeps them)
        self._unquiet: dict[str, _Pending] = {}
        self._closed = False
        self._jobs: queue.Queue = queue.Queue()
        # sessions with an open channel, polled by the sender thread while they have writes in flight
        self._active: set[SendSession] = set()
        self._sender = threading.Thread(target=self._send_loop, name="kv-send", daemon=True)
        self._reaper = threading.Thread(target=self._reap_loop, name="kv-deadlines", daemon=True)
        self._endpoint: RankEndpoint | None = None
        backend.start(self)
        self._sender.start()
        self._reaper.start()

    # == receiver (decode) side ====================================================================
    def endpoint(self) -> RankEndpoint:
        """This rank's entry in a ticket's `ranks` (made once: it never changes, and every ticket carries it)."""
        if self._endpoint is None:
            shard = self.layout.shard
            self._endpoint = RankEndpoint(
                agent=self.name, head_start=shard.head_start, num_heads=shard.num_heads,
                device_id=self.layout.device.index or 0, mem_type="VRAM" if self.layout.is_cuda else "DRAM",
                **self.backend.endpoint_fields())
        return self._endpoint

    def make_ticket(self, request_id: str, block_ids: Sequence[int], skip_blocks: int, deadline: float,
                    ranks: list[RankEndpoint]) -> TransferTicket:
        """A ticket naming `ranks` (every rank of this worker, in rank order) as the receivers."""
        ticket = TransferTicket(
            request_id=request_id, backend=self.backend.name, num_layers=self.layout.num_layers,
            dtype=self.layout.dtype, block_size=self.layout.block_size, num_kv_heads=self.layout.shard.num_kv_heads,
            head_dim=self.layout.head_dim, block_ids=list(block_ids), ranks=ranks, skip_blocks=skip_blocks,
            num_blocks=self.layout.num_blocks, deadline=deadline,
        )
        ticket.validate()
        return ticket

    def expect(self, request_id: str, block_ids: Sequence[int], skip_blocks: int = 0,
               timeout_s: float = 30.0) -> TransferTicket:
        """Publish a ticket for blocks the engine reserved; the transfer must land within `timeout_s`.
        (A worker of one rank; with several, `sharded.ShardedReceiver` composes the ranks' agents.)"""
        if self.layout.shard.world_size != 1:
            raise ValueError("expect() is for a single-rank worker; use ShardedReceiver")
        deadline = time.time() + timeout_s
        ticket = self.make_ticket(request_id, block_ids, skip_blocks, deadline, [self.endpoint()])
        self.expect_local(request_id, block_ids, skip_blocks, deadline)
        return ticket

    def expect_local(self, request_id: str, block_ids: Sequence[int], skip_blocks: int, deadline: float) -> None:
        """Accept writes into these blocks of this rank's shard until `deadline` (unix time)."""
        if any(not 0 <= b < self.layout.num_blocks for b in block_ids):
            raise ValueError("block id out of range of the registered KV cache")
        if not 0 <= skip_blocks < len(block_ids):
            raise ValueError("skip_blocks out of range")
        expected = Expected(request_id, self.layout.num_layers, list(block_ids), skip_blocks, deadline)
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"a transfer for {request_id!r} is already expected")
            self._pending[request_id] = _Pending(expected, time.monotonic())
            self._expected.notify_all()
        metrics.IN_FLIGHT.labels("recv", self.backend.name).inc()

    def _get(self, request_id: str) -> _Pending | None:
        return self._pending.get(request_id) or self._finished.get(request_id)

    def progress(self, request_id: str) -> int:
        """Layers fully landed so far."""
        with self._lock:
            p = self._get(request_id)
            return len(p.layers_done) if p else 0

    def is_expected(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending

    async def wait(self, request_id: str) -> None:
        """Until every layer landed; raises TransferTimeout / TransferError / TransferCancelled."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            p = self._get(request_id)
            if p is None:
                raise TransferError(f"no transfer expected for {request_id!r}")
            if p.done.is_set():
                self._settle(fut, p.error)
            else:
                p.waiters.append((loop, fut))
        await fut

    def wait_blocking(self, request_id: str) -> None:
        with self._lock:
            p = self._get(request_id)
        if p is None:
            raise TransferError(f"no transfer expected for {request_id!r}")
        p.done.wait(max(0.0, p.ticket.deadline - time.time()) + 1.0)
        if not p.done.is_set():
            self._finish(request_id, TransferTimeout(f"{request_id}: deadline passed"))
        if p.error is not None:
            raise p.error

    def cancel(self, request_id: str) -> None:
        self._finish(request_id, TransferCancelled(f"{request_id}: cancelled"))

    def forget(self, request_id: str) -> None:
        """Drop a finished transfer's record (after wait returned or raised); `quiet` still knows it."""
        with self._lock:
            self._finished.pop(request_id, None)

    async def quiet(self, request_id: str) -> None:
        """Until no write of this transfer can land any more; call it after the transfer ended (landed,
        cancelled, failed). An unknown request has nothing in flight."""
        p, timeout = self._quiet_wait(request_id)
        if p is not None:
            await p.quiet.wait_async(timeout)
            self._quieted(request_id, p)

    def quiet_blocking(self, request_id: str) -> None:
        p, timeout = self._quiet_wait(request_id)
        if p is not None:
            p.quiet.wait(timeout)
            self._quieted(request_id, p)

    def _quiet_wait(self, request_id: str) -> tuple[_Pending | None, float | None]:
        """The record to wait on, and for how long: a one-sided sender posts nothing after the deadline, while
        our own frames in progress end by themselves (the backend's I/O timeout bounds them)."""
        with self._lock:
            p = self._unquiet.get(request_id) or self._pending.get(request_id)
        if p is None:
            return None, None
        return p, max(0.0, p.ticket.deadline - time.time()) if self.backend.one_sided else None

    def _quieted(self, request_id: str, p: _Pending) -> None:
        with self._lock:
            if self._unquiet.get(request_id) is p:
                del self._unquiet[request_id]
        p.quiet.set()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- called by backends ------------------------------------------------------------------------
    def wait_for_pending(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until some transfer is expected; True if one is.

        Pollers idle here instead of spinning: `expect()` wakes them at once.
        """
        with self._lock:
            if not self._pending:
                self._expected.wait(timeout)  # an early (spurious) return only makes the caller look sooner
            return bool(self._pending)

    def lookup(self, request_id: str) -> Expected | None:
        with self._lock:
            p = self._pending.get(request_id)
            return None if p is None or p.done.is_set() else p.ticket

    def begin_write(self, request_id: str) -> Expected | None:
        """`lookup` for a frame about to be written into the request's blocks on our side: counted until
        `end_write`, so the blocks of a transfer that ends meanwhile are not freed under it. None: refuse it."""
        with self._lock:
            p = self._pending.get(request_id)
            if p is None or p.done.is_set():
                return None
            p.writing += 1
            return p.ticket

    def end_write(self, request_id: str) -> None:
        with self._lock:
            p = self._pending.get(request_id) or self._unquiet.get(request_id)
            if p is None:
                return
            p.writing -= 1
            quiet = p.done.is_set() and p.writing == 0
        if quiet:
            self._quieted(request_id, p)

    def sender_stopped(self, request_id: str) -> None:
        """A sender of a one-sided backend said it writes no more (its abort notice, or its request notice
        after every write completed)."""
        with self._lock:
            p = self._pending.get(request_id) or self._unquiet.get(request_id)
            if p is None:
                return
            p.stopped += 1
            quiet = p.done.is_set() and p.stopped >= max(1, p.num_src)
        if quiet:
            self._quieted(request_id, p)

    def landed(self, request_id: str, layer: int, parts: Sequence[int], final: bool, nbytes: int,
               src: int = 0, num_src: int = 1) -> None:
        """Bytes of `layer`'s K (0) and/or V (1) landed from sender rank `src`, one of `num_src` sender ranks
        routed here (layer -1: every layer); `final` marks that sender's last write of that layer."""
        complete = False
        bad = None
        with self._lock:
            p = self._pending.get(request_id)
            if p is None or p.done.is_set():
                return
            if num_src < 1 or (p.num_src and p.num_src != num_src):
                bad = TransferError(f"{request_id}: {num_src} senders announced, {p.num_src} before")
            else:
                p.num_src = num_src
                p.bytes += nbytes
                if final:
                    for i in range(p.ticket.num_layers) if layer < 0 else (layer,):
                        got = p.final_parts.setdefault(i, set())
                        got.update((src, kv) for kv in parts)
                        if len(got) == 2 * num_src:
                            p.layers_done.add(i)
                    complete = len(p.layers_done) == p.ticket.num_layers
        if bad is not None:
            self._finish(request_id, bad)
            return
        metrics.BYTES.labels("recv", self.backend.name).inc(nbytes)
        if complete:
            self._finish(request_id, None)

    def sender_done(self, request_id: str, src: int) -> bool:
        """Whether sender rank `src` made its final write of every layer's K and V for this request."""
        with self._lock:
            p = self._pending.get(request_id)
            if p is None:
                return True
            return all({(src, 0), (src, 1)} <= p.final_parts.get(i, set()) for i in range(p.ticket.num_layers))

    def fail(self, request_id: str, error: TransferError) -> None:
        self._finish(request_id, error)

    # -- endings ---------------------------------------------------------------------------------
    def _finish(self, request_id: str, error: TransferError | None) -> None:
        with self._lock:
            p = self._pending.get(request_id)
            if p is None or p.done.is_set():
                return
            p.error = error
            p.done.set()
            waiters, p.waiters = p.waiters, []
            del self._pending[request_id]
            self._finished[request_id] = p
            while len(self._finished) > 4096:
                self._finished.popitem(last=False)
            if error is None or (p.writing == 0 if not self.backend.one_sided else p.stopped >= max(1, p.num_src)):
                p.quiet.set()  # landed whole (every write is in), or nothing of it is under way
            else:
                self._unquiet[request_id] = p
                now = time.time()  # those nobody waited for leave at their deadline (writes end by then)
                for rid in [r for r, q in self._unquiet.items() if q.ticket.deadline + 60 < now]:
                    self._unquiet.pop(rid).quiet.set()
        metrics.record_end("recv", self.backend.name, error, time.monotonic() - p.created)
        if error is not None:
            log.warning("kv transfer %s failed: %s", request_id, error)
        for loop, fut in waiters:
            loop.call_soon_threadsafe(self._settle, fut, error)
        if self.on_finish is not None:
            self.on_finish(request_id, error)

    @staticmethod
    def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    def _reap_loop(self) -> None:
        while not self._closed:
            if not self.wait_for_pending(1.0):  # nothing pending: nothing can expire
                continue
            now = time.time()
            with self._lock:
                late = [rid for rid, p in self._pending.items() if not p.done.is_set() and now > p.ticket.deadline]
            for rid in late:
                self._finish(rid, TransferTimeout(f"{rid}: not complete by its deadline"))
            time.sleep(REAP_S)

    # == sender (prefill) side =====================================================================
    def begin(self, ticket: TransferTicket, src_block_ids: Sequence[int]) -> SendSession:
        """Start sending this rank's routes into a ticket's blocks from our `src_block_ids` (same order; a prefix
        of the prompt's blocks is enough to start, the session's list may grow as blocks are allocated)."""
        ticket.validate()
        ticket.check_compatible(self.layout)
        if ticket.backend != self.backend.name:
            raise MalformedTicket(f"ticket is for backend {ticket.backend}, this agent runs {self.backend.name}")
        if len(src_block_ids) > len(ticket.block_ids):
            raise MalformedTicket(f"ticket has {len(ticket.block_ids)} blocks, sender has {len(src_block_ids)}")
        if any(not 0 <= b < self.layout.num_blocks for b in src_block_ids):
            raise ValueError("source block id out of range")
        shard = self.layout.shard
        routes = [r for r in plan_routes(ticket.num_kv_heads, shard.world_size, len(ticket.ranks))
                  if r.src_rank == shard.rank]
        return SendSession(self, ticket, list(src_block_ids), routes)

    def _send_loop(self) -> None:
        busy = False  # writes may be in flight: poll every SEND_POLL_S; otherwise block until the next job
        while True:
            try:
                job = self._jobs.get(timeout=SEND_POLL_S if busy else None)
            except queue.Empty:
                # keep in-flight writes progressing between layers; only this thread posts writes, so once
                # none remain nothing changes until the next job
                busy = self.poll_sends()
                continue
            if job is None:
                return
            job()
            busy = bool(self._active)  # the job may have posted writes: the next poll tells

    def poll_sends(self) -> bool:
        """Progress every session's in-flight writes (on the sender thread); True while some remain."""
        return any([session._poll() for session in list(self._active)])  # a list: poll every one

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            ids = list(self._pending)
        for rid in ids:
            self._finish(rid, TransferCancelled(f"{rid}: agent closed"))
        self._jobs.put(None)
        self._sender.join(timeout=5)
        self.backend.close()


def is_loopback(host: str) -> bool:
    """Whether `host` (the address the worker binds) is a loopback address or name."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def make_agent(kind: str, layout: KVLayout, host: str = "127.0.0.1", port: int = 0,
               name: str | None = None) -> KVTransferAgent:
    """`kind`: auto (nixl when it imports and its agent starts, else tcp), nixl or tcp. Every listener binds
    `host`'s interface: TCP binds `host`; with a loopback `host` NIXL's UCX is kept to the loopback device."""
    if kind not in ("auto", "nixl", "tcp"):
        raise ValueError(f"kv transport must be auto, nixl or tcp, got {kind!r}")
    name = name or f"splitserve-{uuid.uuid4().hex[:12]}"
    if kind in ("auto", "nixl"):
        try:
            from splitserve.kv_transfer.nixl_backend import NixlBackend

            backend = NixlBackend(name, loopback_only=is_loopback(host))
            log.info("kv transport: nixl (agent %s)", name)
            return KVTransferAgent(layout, backend, name)
        except Exception as e:
            if kind == "nixl":
                raise
            log.info("kv transport: tcp (nixl unavailable: %s)", e)
    from splitserve.kv_transfer.tcp_backend import TcpBackend

    return KVTransferAgent(layout, TcpBackend(host, port), name)
