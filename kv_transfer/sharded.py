"""Workers with several tensor-parallel ranks: every rank has its own transfer agent over its own KV shard, and
rank 0 composes them into the one agent its role's service uses (`make_worker_agent`).

- Decode (`ShardedReceiver`): `expect` tells each receiving follower (the first holder of some head,
  `shards.receivers`) to accept the request's writes, then publishes one ticket naming every rank; `wait`
  ends when every receiving rank reported its part landed, and fails as soon as one reports a failure, misses
  the deadline, or its process is gone. After a `cancel`, `quiet` ends once every rank (or its process) said
  no write of the request can land on it any more.
- Prefill (`ShardedSender`): `begin` hands the ticket to every follower before the request's first step; each
  step's `rank_plan` (made by `KVStreamHook`) tells the followers' connectors which blocks to send while the
  layers are written; `finish` waits for every rank's writes, `abort` stops them all.

The followers' side is `rank_connector.FollowerConnector`. Rank 0 and a follower talk over the engine's
`RankLink`; the messages and the plan encoding are defined here, in one place.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.common.latch import Latch
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.parallel_link import LinkClosed, RankLink
from splitserve.kv_transfer.agent import KVTransferAgent, SendSession, make_agent
from splitserve.kv_transfer.errors import TransferCancelled, TransferError, TransferTimeout
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.shards import receivers
from splitserve.kv_transfer.ticket import RankEndpoint, TransferTicket

log = logging.getLogger("splitserve.kv_transfer.sharded")

# -- the link messages (rank 0 -> follower, with a reply) --------------------------------------------------
OP_START = "kv.start"  # {backend, host} -> {endpoint: RankEndpoint as JSON}: start this rank's agent
OP_EXPECT = "kv.expect"  # {rid, block_ids, skip_blocks, deadline}: accept writes for rid into these blocks
OP_CANCEL = "kv.cancel"  # {rid} (no reply): stop accepting rid
OP_STREAM = "kv.stream"  # {sid, ticket}: stream sid (numbered by rank 0) goes into this ticket's blocks
OP_ABORT = "kv.abort"  # {sid}: stop sending sid
# -- (follower -> rank 0, no reply) ------------------------------------------------------------------------
OP_LANDED = "kv.landed"  # {rid, error}: this rank's part of rid landed (error null) or failed
OP_SENT = "kv.sent"  # {sid, bytes, error}: this rank's writes of sid are done (error null) or failed
OP_QUIET = "kv.quiet"  # {rid}: after kv.cancel, no write of rid can land on this rank any more

LINK_TIMEOUT_S = 10.0  # seconds to wait for a follower's reply (a local socket: normally well under 1 ms)
START_TIMEOUT_S = 120.0  # seconds for a follower to start its agent


@dataclass
class PlanEntry:
    """One stream's part of a step: send prompt blocks [start, stop) of every layer as it is written."""

    sid: int
    start: int
    stop: int
    final: bool  # the stream's last chunk: its layers are complete after this step
    src_block_ids: list[int]  # the sender's blocks for prompt blocks 0..stop-1 (the same ids on every rank)

    def encode(self) -> list[int]:
        return [self.sid, self.start, self.stop, int(self.final), len(self.src_block_ids), *self.src_block_ids]


def decode_plan(plan: Sequence[int]) -> list[PlanEntry]:
    """The entries of a step's `rank_plan`; raises ValueError on a malformed one."""
    out, i = [], 0
    while i < len(plan):
        if i + 5 > len(plan):
            raise ValueError("rank plan: truncated entry")
        sid, start, stop, final, n = plan[i : i + 5]
        src = list(plan[i + 5 : i + 5 + n])
        if len(src) != n or not 0 <= start <= stop <= n or final not in (0, 1):
            raise ValueError("rank plan: inconsistent entry")
        out.append(PlanEntry(sid, start, stop, bool(final), src))
        i += 5 + n
    return out


def make_worker_agent(kind: str, engine: AsyncEngine, host: str, role: str
                      ) -> KVTransferAgent | ShardedReceiver | ShardedSender:
    """The transfer agent of a worker: one agent on one rank; with several ranks, rank 0's agent composed
    with every follower's (each started over its link, on the backend rank 0's agent chose)."""
    agent = make_agent(kind, KVLayout(engine.kv_tensors(), engine.kv_shard), host)
    links = engine.follower_links()
    if not links:
        return agent
    try:
        endpoints = [agent.endpoint()]
        for link in links:
            reply = link.request({"op": OP_START, "backend": agent.backend.name, "host": host}, START_TIMEOUT_S)
            endpoints.append(RankEndpoint.from_json(reply["endpoint"]))
    except BaseException:
        agent.close()
        raise
    log.info("kv transfer over %d ranks (%s): %s", len(endpoints), role, ", ".join(e.agent for e in endpoints))
    return ShardedReceiver(agent, links, endpoints) if role == "decode" else ShardedSender(agent, links)


# == decode: rank 0 gathers every receiving rank's outcome ====================================================
@dataclass
class _Gather:
    outstanding: set[int]  # follower ranks whose part has not landed yet
    deadline: float
    error: TransferError | None = None
    done: Latch = field(default_factory=Latch)
    unquiet: set[int] = field(default_factory=set)  # cancelled follower ranks that have not said kv.quiet
    quiet: Latch = field(default_factory=Latch)


class ShardedReceiver:
    """`KVTransferAgent`'s receiver face over every rank of a decode worker."""

    def __init__(self, agent: KVTransferAgent, links: list[RankLink], endpoints: list[RankEndpoint]) -> None:
        self.agent = agent
        self.layout = agent.layout
        self.name = agent.name
        self.backend = agent.backend
        self.links = links
        self.endpoints = endpoints
        self._receiving = [r for r in receivers(self.layout.shard.num_kv_heads, len(endpoints)) if r != 0]
        self._lock = threading.Lock()
        self._pending: dict[str, _Gather] = {}
        self._unquiet: dict[str, _Gather] = {}  # cancelled, until every rank said kv.quiet (`forget` keeps it)
        for r, link in enumerate(links, start=1):
            link.handle(OP_LANDED, lambda msg, r=r: self._on_landed(r, msg))
            link.handle(OP_QUIET, lambda msg, r=r: self._on_quiet(r, msg))
            link.on_close(lambda r=r: self._rank_gone(r))

    def expect(self, request_id: str, block_ids: Sequence[int], skip_blocks: int = 0,
               timeout_s: float = 30.0) -> TransferTicket:
        deadline = time.time() + timeout_s
        ticket = self.agent.make_ticket(request_id, block_ids, skip_blocks, deadline, self.endpoints)
        gather = _Gather(set(self._receiving), deadline)
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"a transfer for {request_id!r} is already expected")
            self._pending[request_id] = gather
        msg = {"op": OP_EXPECT, "rid": request_id, "block_ids": list(block_ids), "skip_blocks": skip_blocks,
               "deadline": deadline}
        try:
            for r in self._receiving:  # each acknowledges before the ticket leaves: no write finds it unready
                self.links[r - 1].request(msg, LINK_TIMEOUT_S)
            self.agent.expect_local(request_id, block_ids, skip_blocks, deadline)
        except BaseException as e:
            self._cancel_followers(request_id, gather.outstanding)
            with self._lock:
                self._pending.pop(request_id, None)
            raise TransferError(f"{request_id}: a rank could not expect the transfer: {e}") from e
        return ticket

    async def wait(self, request_id: str) -> None:
        """Until every rank's part landed; raises TransferTimeout / TransferError / TransferCancelled."""
        with self._lock:
            gather = self._pending.get(request_id)
        if gather is None:
            raise TransferError(f"no transfer expected for {request_id!r}")
        await self.agent.wait(request_id)  # rank 0's own part
        if not await gather.done.wait_async(max(0.0, gather.deadline - time.time()) + 1.0):
            raise TransferTimeout(f"{request_id}: ranks {sorted(gather.outstanding)} did not report in time")
        if gather.error is not None:
            raise gather.error

    def cancel(self, request_id: str) -> None:
        self.agent.cancel(request_id)
        with self._lock:
            gather = self._pending.get(request_id)
            if gather is not None and gather.outstanding:  # ranks that landed their part have nothing under way
                gather.unquiet = set(gather.outstanding)
                self._unquiet[request_id] = gather
        if gather is not None:
            self._cancel_followers(request_id, gather.outstanding)
            self._settle(gather, TransferCancelled(f"{request_id}: cancelled"))

    async def quiet(self, request_id: str) -> None:
        """After `cancel`: until no write of the request can land on any rank any more."""
        await self.agent.quiet(request_id)
        with self._lock:
            gather = self._unquiet.get(request_id)
        if gather is not None:  # each rank answers once its own agent is quiet (bounded by the deadline)
            if not await gather.quiet.wait_async(max(0.0, gather.deadline - time.time()) + 60.0):
                log.warning("%s: ranks %s did not say kv.quiet; freeing anyway", request_id, sorted(gather.unquiet))
            with self._lock:
                self._unquiet.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self.agent.forget(request_id)
        with self._lock:
            self._pending.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self.agent.close()

    def _cancel_followers(self, request_id: str, ranks: set[int]) -> None:
        with self._lock:  # the link threads discard from `ranks` as the ranks report
            ranks = set(ranks)
        for r in sorted(ranks):
            try:
                self.links[r - 1].send({"op": OP_CANCEL, "rid": request_id})
            except LinkClosed:
                pass

    def _on_landed(self, rank: int, msg: dict) -> None:
        with self._lock:
            gather = self._pending.get(msg.get("rid", ""))
        if gather is None:
            return
        if msg.get("error"):
            self._settle(gather, TransferError(f"rank {rank}: {msg['error']}"))
            return
        with self._lock:
            gather.outstanding.discard(rank)
            complete = not gather.outstanding
        if complete:
            gather.done.set()

    def _rank_gone(self, rank: int) -> None:
        with self._lock:
            hit = [g for g in self._pending.values() if rank in g.outstanding]
            rids = [rid for rid, g in self._unquiet.items() if rank in g.unquiet]
        for gather in hit:
            self._settle(gather, TransferError(f"rank {rank} is gone"))
        for rid in rids:  # a rank whose process is gone writes nothing
            self._on_quiet(rank, {"rid": rid})

    def _on_quiet(self, rank: int, msg: dict) -> None:
        with self._lock:
            gather = self._unquiet.get(msg.get("rid", ""))
            if gather is None:
                return
            gather.unquiet.discard(rank)
            quiet = not gather.unquiet
        if quiet:
            gather.quiet.set()

    @staticmethod
    def _settle(gather: _Gather, error: TransferError) -> None:
        if gather.error is None and not gather.done.is_set():
            gather.error = error
        gather.done.set()


# == prefill: rank 0's session plus every follower's ==========================================================
class ShardedSendSession:
    """A `SendSession` over every rank: rank 0's own writes here, the followers' from each step's plan."""

    def __init__(self, owner: ShardedSender, sid: int, local: SendSession) -> None:
        self.owner = owner
        self.plan_id = sid  # how the step plan names this stream
        self.local = local
        self.ticket = local.ticket
        self._lock = threading.Lock()
        self._waiting = set(range(1, len(owner.links) + 1))  # followers yet to report their writes done
        self._follower_bytes = 0
        self._error: TransferError | None = None
        self._done = threading.Event()
        if not self._waiting:
            self._done.set()

    @property
    def src_block_ids(self) -> list[int]:
        return self.local.src_block_ids

    @src_block_ids.setter
    def src_block_ids(self, value: list[int]) -> None:
        self.local.src_block_ids = value

    @property
    def bytes(self) -> int:
        return self.local.bytes + self._follower_bytes

    @property
    def error(self) -> TransferError | None:
        return self.local.error or self._error

    def send_layer(self, layer: int, indices: range | None = None, final: bool = True,
                   event: torch.cuda.Event | None = None) -> None:
        self.local.send_layer(layer, indices, final, event)

    def send_all(self, indices: range | None = None, event: torch.cuda.Event | None = None) -> None:
        self.local.send_all(indices, event)

    def finish(self, timeout: float | None = None) -> None:
        """Wait until every rank's writes are done; raises the first error (and stops the other ranks)."""
        if timeout is None:
            timeout = max(0.0, self.ticket.deadline - time.time()) + 1.0
        end = time.monotonic() + timeout
        try:
            self.local.finish(timeout)
            if not self._done.wait(max(0.0, end - time.monotonic())):
                raise TransferTimeout(f"{self.ticket.request_id}: ranks {sorted(self._waiting)} did not finish sending")
            if self._error is not None:
                raise self._error
        except TransferError:
            self.abort()
            raise
        finally:
            self.owner._sessions.pop(self.plan_id, None)

    def abort(self) -> None:
        self.local.abort()
        self.owner._abort_followers(self.plan_id)
        self.owner._sessions.pop(self.plan_id, None)

    def _reported(self, rank: int, msg: dict) -> None:
        with self._lock:
            self._waiting.discard(rank)
            self._follower_bytes += int(msg.get("bytes") or 0)
            if msg.get("error") and self._error is None:
                self._error = TransferError(f"rank {rank}: {msg['error']}")
            if not self._waiting or self._error is not None:
                self._done.set()


class ShardedSender:
    """`KVTransferAgent`'s sender face over every rank of a prefill worker."""

    def __init__(self, agent: KVTransferAgent, links: list[RankLink]) -> None:
        self.agent = agent
        self.layout = agent.layout
        self.name = agent.name
        self.backend = agent.backend
        self.links = links
        self._ids = itertools.count(1)
        self._sessions: dict[int, ShardedSendSession] = {}
        for r, link in enumerate(links, start=1):
            link.handle(OP_SENT, lambda msg, r=r: self._on_sent(r, msg))
            link.on_close(lambda r=r: self._rank_gone(r))

    def begin(self, ticket: TransferTicket, src_block_ids: Sequence[int]) -> ShardedSendSession:
        """Rank 0's session, and the ticket handed to every follower (acknowledged before the first step that
        streams it, so its plan never names a stream a follower does not know)."""
        local = self.agent.begin(ticket, src_block_ids)
        session = ShardedSendSession(self, next(self._ids), local)
        self._sessions[session.plan_id] = session
        msg = {"op": OP_STREAM, "sid": session.plan_id, "ticket": ticket.encode().decode()}
        try:
            for link in self.links:
                link.request(msg, LINK_TIMEOUT_S)
        except BaseException as e:
            session.abort()
            raise TransferError(f"{ticket.request_id}: a rank could not take the stream: {e}") from e
        return session

    def close(self) -> None:
        self.agent.close()

    def _abort_followers(self, sid: int) -> None:
        for link in self.links:
            try:
                link.send({"op": OP_ABORT, "sid": sid})
            except LinkClosed:
                pass

    def _on_sent(self, rank: int, msg: dict) -> None:
        session = self._sessions.get(msg.get("sid", -1))
        if session is not None:
            session._reported(rank, msg)

    def _rank_gone(self, rank: int) -> None:
        for session in list(self._sessions.values()):
            session._reported(rank, {"error": "the rank is gone"})
