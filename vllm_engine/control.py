"""The worker's end of the line to the layer-wise connectors inside its vLLM server: a ZMQ ROUTER bound on loopback
(the connectors' DEALERs connect to it, `in_vllm.control_link`), on the worker's event loop.

It learns who listens from their hellos (the scheduler, and each model-runner rank), sends tickets, drops and
releases to every rank, and resolves what the connectors report: a reservation's blocks (`reserved`), a reservation
that ended (`landed`, one per rank), a producer's transfer that ended (`sent`, one per rank), and the transport
NIXL uses toward each peer (`transport`, until the peer is `dropped`; `transports`, and the `splitserve_kv_transport`
metric, warning once when two GPU workers talk over TCP). Messages are validated by `in_vllm.layerwise_wire`; one that does not parse is
dropped and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import Gauge

from splitserve.vllm_engine.in_vllm.layerwise_wire import HELLO_S, WireError, decode_message, encode_message

log = logging.getLogger("splitserve.vllm")

KV_TRANSPORT = Gauge("splitserve_kv_transport", "1 for the transport this worker's NIXL agent uses toward a peer "
                     "(cuda_ipc, rdma, tcp, shm), as UCX reported its choice", ["peer", "transport"])
PEER_TIMEOUT_S = 15 * HELLO_S  # a connector silent this long is gone (its server restarted); a loaded host is slow


@dataclass
class _Ending:
    """A reservation's or transfer's end, as the ranks report it."""

    ranks: int
    future: asyncio.Future
    oks: int = 0
    nbytes: int = 0


@dataclass
class _Peer:
    side: str
    dp: int
    rank: int
    engine: str
    seen: float = field(default_factory=time.monotonic)


class ControlServer:
    def __init__(self, endpoint: str, tp_size: int) -> None:
        self.endpoint = endpoint
        self.tp_size = tp_size
        self._sock: Any = None
        self._task: asyncio.Task | None = None
        self._peers: dict[bytes, _Peer] = {}
        self._reserved: dict[str, asyncio.Future] = {}
        self._endings: dict[tuple[str, str], _Ending] = {}  # (landed | sent, key)
        self.transports: dict[str, str] = {}  # peer -> transport
        self._warned_tcp = False

    def bind(self) -> None:
        """Bind before the server starts (its connectors connect to us)."""
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self._sock = sock

    def start(self) -> None:
        if self._sock is None:
            self.bind()
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for fut in [*self._reserved.values(), *(e.future for e in self._endings.values())]:
            if not fut.done():
                fut.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)

    # -- what the handovers ask --------------------------------------------------------------------------------
    def workers(self) -> list[bytes]:
        cutoff = time.monotonic() - PEER_TIMEOUT_S
        return [ident for ident, p in self._peers.items() if p.side == "worker" and p.seen >= cutoff]

    def connected(self) -> bool:
        """Whether the server's connectors are listening (its scheduler and at least one rank said hello)."""
        cutoff = time.monotonic() - PEER_TIMEOUT_S
        sides = {p.side for p in self._peers.values() if p.seen >= cutoff}
        return {"scheduler", "worker"} <= sides

    def expect_reserved(self, key: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._reserved[key] = fut
        return fut

    def expect(self, kind: str, key: str) -> asyncio.Future:
        """A future of (every rank ok, bytes, reason) for `landed` or `sent` of `key`."""
        fut = asyncio.get_running_loop().create_future()
        self._endings[(kind, key)] = _Ending(self.tp_size, fut)
        return fut

    def forget(self, key: str) -> None:
        fut = self._reserved.pop(key, None)
        if fut is not None and not fut.done():
            fut.cancel()
        for kind in ("landed", "sent"):
            e = self._endings.pop((kind, key), None)
            if e is not None and not e.future.done():
                e.future.cancel()

    async def to_workers(self, kind: str, **fields: Any) -> int:
        """Send a message to every rank that said hello lately; how many."""
        raw = encode_message(kind, **fields)
        targets = self.workers()
        for ident in targets:
            try:
                await self._sock.send_multipart([ident, raw], flags=zmq.NOBLOCK)
            except zmq.Again:  # that rank's queue is full: it is stuck, and deadlines cover it
                log.debug("control: %s to a rank not sent", kind)
        return len(targets)

    # -- what the connectors report ----------------------------------------------------------------------------
    async def _run(self) -> None:
        warned = False
        while True:
            ident, raw = await self._recv()
            try:
                kind, f = decode_message(raw)
            except WireError as e:
                if not warned:
                    log.warning("control: dropped a message from vLLM's connector: %s", e)
                    warned = True
                continue
            self._on(ident, kind, f)

    async def _recv(self) -> tuple[bytes, bytes]:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) == 2:
                return frames[0], frames[1]

    def _on(self, ident: bytes, kind: str, f: dict[str, Any]) -> None:
        if kind == "hello":
            peer = self._peers.get(ident)
            if peer is None:
                # a rank that restarted says hello under a new identity: the old one goes
                for old, p in list(self._peers.items()):
                    if (p.side, p.dp, p.rank) == (f["side"], f["dp"], f["rank"]):
                        del self._peers[old]
                self._peers[ident] = _Peer(f["side"], f["dp"], f["rank"], f["engine"])
                log.info("control: vLLM %s (dp %d rank %d, engine %s) connected", f["side"], f["dp"], f["rank"],
                         f["engine"])
            else:
                peer.seen = time.monotonic()
        elif kind == "reserved":
            fut = self._reserved.pop(f["key"], None)
            if fut is not None and not fut.done():
                fut.set_result(f)
        elif kind in ("landed", "sent"):
            e = self._endings.get((kind, f["key"]))
            if e is None or e.future.done():
                return
            if not f["ok"]:
                e.future.set_result((False, e.nbytes + f["bytes"], f["reason"]))
                self._endings.pop((kind, f["key"]), None)
                return
            e.oks += 1
            e.nbytes += f["bytes"]
            if e.oks >= e.ranks:
                e.future.set_result((True, e.nbytes, ""))
                self._endings.pop((kind, f["key"]), None)
        elif kind == "transport":
            self._transport(f)
        elif kind == "dropped":
            old = self.transports.pop(f["host"], None)
            if old is not None:
                KV_TRANSPORT.remove(f["host"], old)

    def _transport(self, f: dict[str, Any]) -> None:
        peer, transport = f["host"], f["transport"]
        old = self.transports.get(peer)
        if old == transport:
            return
        if old is not None:
            KV_TRANSPORT.remove(peer, old)
        self.transports[peer] = transport
        KV_TRANSPORT.labels(peer, transport).set(1)
        log.info("NIXL toward %s (%s): %s", peer, f["peer"], transport)
        if transport == "tcp" and f["local_mem"] == "VRAM" and f["remote_mem"] == "VRAM" and not self._warned_tcp:
            self._warned_tcp = True
            log.warning("two GPU workers exchange KV over TCP (NIXL toward %s): check UCX_TLS and the network "
                        "devices (cuda_ipc on one host, an RDMA lane across hosts)", peer)
