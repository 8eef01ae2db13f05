"""The layerwise connector's NIXL ground on one rank (worker side): this rank's KV cache as NIXL regions, registered
once, its metadata served at the side channel for the prefill ranks that write here (`LocalKV`), and the decode
ranks this rank writes to (`Peers`): their metadata fetched on a thread of its own, loaded into NIXL on the mover's
thread (which makes every NIXL call), and asked every `PROBE_S` who answers at their address, so an agent that is
gone or replaced (a restarted server is a new agent) is dropped.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from splitserve.vllm_engine.in_vllm.layerwise_wire import AgentInfo, LayerwiseTicket, Region, WireError

log = logging.getLogger("splitserve.vllm_layerwise")

FETCH_TIMEOUT_S = 5.0  # a decode rank's metadata
PROBE_S, PROBE_TIMEOUT_S = 5.0, 2.0  # how often loaded peers are asked who they are, and how long they may take
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class LocalKV:
    """This rank's KV cache for NIXL: each layer's blocks as regions (in layer order), registered, a prepped
    descriptor list of every block, and the `AgentInfo` a decode rank serves."""

    def __init__(self, nixl: Any, agent_name: str, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        names = sorted(kv_caches, key=lambda n: (_layer_index(n), list(kv_caches).index(n)))
        self.layer_index = {n: i for i, n in enumerate(names)}
        first = kv_caches[names[0]]
        self.cuda = first.is_cuda
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.device_id = first.device.index or 0
        regions: list[Region] = []
        per_layer = 0
        for name in names:
            rs = _regions(kv_caches[name], num_blocks, name)
            if per_layer and len(rs) != per_layer:
                raise ValueError(f"layer {name}: {len(rs)} KV regions, other layers {per_layer}")
            per_layer = len(rs)
            regions += rs
        self.regions = tuple(regions)
        self.regions_per_layer = per_layer
        self.num_layers = len(names)
        storages: dict[int, int] = {}  # layers may be views of one buffer: each storage registered once
        for kv in kv_caches.values():
            s = kv.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        self.registration = nixl.register_memory([(ptr, n, self.device_id, "") for ptr, n in storages.items()],
                                                 self.mem_type)
        self.prep, self.offsets = prep_blocks(nixl, "NIXL_INIT_AGENT", self.regions, self.device_id, self.mem_type)
        self.info = AgentInfo(agent_name, nixl.get_agent_metadata(), self.mem_type, self.device_id, per_layer,
                              self.regions)

    def shape(self) -> tuple[int, tuple[int, ...]]:
        return self.num_layers, tuple(r.block_bytes for r in self.regions[:self.regions_per_layer])

    def serve(self, endpoint: str, closed: threading.Event) -> threading.Thread:
        """Answer at `endpoint` with this rank's `AgentInfo` (a thread, until `closed`)."""
        sock = zmq.Context.instance().socket(zmq.ROUTER)  # no request/reply state to wedge on a peer that left
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise RuntimeError(f"the layerwise KV connector cannot serve its NIXL metadata at {endpoint}: {e} "
                               f"(vllm.sideChannelPort)") from None
        raw = self.info.encode()

        def run() -> None:
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            try:
                while not closed.is_set():
                    if not poller.poll(200):
                        continue
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                        sock.send_multipart([*frames[:-1], raw], zmq.NOBLOCK)  # the envelope, then the answer
                    except zmq.ZMQError as e:  # the asker left, or our queue to it is full: it asks again
                        log.debug("metadata server: %s", e)
            finally:
                sock.close(linger=0)

        thread = threading.Thread(target=run, name="splitserve-kv-meta", daemon=True)
        thread.start()
        return thread


@dataclass
class Peer:
    endpoint: str
    info: AgentInfo
    prep: Any  # its prepped descriptor list
    offsets: np.ndarray  # first flat index of each (layer, region) row of that list
    reported: bool = False  # its transport went to the worker


class Peers:
    """The decode ranks a prefill rank writes to. `want` asks the loader thread for a ticket's peer; it answers
    through `post` (the mover's queue) with ("peer", key, name, endpoint, info or None, error), and asks for drops
    with ("drop_peer", name, why). `load` and `drop` run on the mover's thread."""

    def __init__(self, nixl: Any, local: LocalKV, tp_rank: int, post: Callable[[tuple], None],
                 on_drop: Callable[[str, str], None], closed: threading.Event) -> None:
        self.nixl, self.local, self.tp_rank = nixl, local, tp_rank
        self.post, self.on_drop, self.closed = post, on_drop, closed
        self._peers: dict[str, Peer] = {}  # agent name -> peer
        self._lock = threading.Lock()  # the mover thread changes the peers, the loader thread reads them
        self._wanted: queue.Queue[tuple[str, LayerwiseTicket] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="splitserve-kv-peers", daemon=True)
        self._thread.start()

    def want(self, key: str, ticket: LayerwiseTicket) -> None:
        self._wanted.put((key, ticket))

    def get(self, name: str) -> Peer | None:
        with self._lock:
            return self._peers.get(name)

    def known(self, name: str) -> bool:
        return self.get(name) is not None

    def name_of(self, ticket: LayerwiseTicket) -> str:
        return f"ss-{ticket.engine}-dp{ticket.dp_rank}-tp{self.tp_rank}"

    # -- the loader thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        next_probe = time.monotonic() + PROBE_S
        while not self.closed.is_set():
            try:
                item = self._wanted.get(timeout=max(0.0, next_probe - time.monotonic()))
            except queue.Empty:
                self._probe()
                next_probe = time.monotonic() + PROBE_S
                continue
            if item is None:
                return
            key, ticket = item
            name, endpoint = self.name_of(ticket), ticket.rank_endpoint(self.tp_rank)
            info, error = None, ""
            if not self.known(name):
                try:
                    info = self._fetch(name, endpoint)
                except (WireError, RuntimeError, zmq.ZMQError) as e:
                    error = str(e) or type(e).__name__
            self.post(("peer", key, name, endpoint, info, error))

    def _fetch(self, name: str, endpoint: str) -> AgentInfo:
        info = AgentInfo.decode(fetch(endpoint))
        if info.agent != name:
            raise WireError(f"the agent there is {info.agent!r}, the ticket names {name!r} (a restarted server?)")
        if info.shape() != self.local.shape():
            raise WireError(f"its KV layout (layers, block bytes per region) {info.shape()} differs from this "
                            f"server's {self.local.shape()}")
        return info

    def _probe(self) -> None:
        with self._lock:
            peers = [(name, peer.endpoint) for name, peer in self._peers.items()]
        for name, endpoint in peers:
            try:
                answer = AgentInfo.decode(fetch(endpoint, PROBE_TIMEOUT_S)).agent
            except (WireError, RuntimeError, zmq.ZMQError) as e:
                answer = f"nothing ({e})"
            if answer != name:
                self.post(("drop_peer", name, f"{answer} answers at {endpoint}"))

    # -- the mover's thread ----------------------------------------------------------------------------------------
    def load(self, name: str, endpoint: str, info: AgentInfo) -> tuple[Peer | None, str]:
        """(the peer, "") once its agent is loaded into NIXL, or (None, why); an agent loaded before at the same
        address is dropped (that server restarted)."""
        with self._lock:
            stale = [n for n, p in self._peers.items() if p.endpoint == endpoint]
        for old in stale:
            self.drop(old, f"{name} answers at {endpoint} now")
        try:
            self.nixl.add_remote_agent(info.metadata)
            prep, offsets = prep_blocks(self.nixl, info.agent, info.regions, info.device_id, info.mem_type)
        except Exception as e:  # noqa: BLE001  NIXL's own errors: the metadata did not load
            return None, f"NIXL could not load agent {info.agent}: {e}"
        peer = Peer(endpoint, info, prep, offsets)
        with self._lock:
            self._peers[name] = peer
        log.info("NIXL agent %s loaded (%s)", name, endpoint)
        return peer, ""

    def drop(self, name: str, why: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
        if peer is None:
            return
        log.info("dropping NIXL agent %s: %s", name, why)
        try:
            self.nixl.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001  already gone in NIXL: nothing left to drop
            log.debug("remove_remote_agent %s: %s", name, e)
        self.on_drop(name, peer.endpoint)

    def close(self) -> None:
        self._wanted.put(None)
        self._thread.join(timeout=2.0)


def _layer_index(name: str) -> int:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else 1 << 30


def _dense(block: torch.Tensor) -> bool:
    """Whether a block's elements fill one span of memory with no gaps, in whatever order its dimensions are laid
    out: a backend's cache may be a permuted view (Hopper's FlashAttention: [blocks, heads, positions, 2 x head_dim]
    over memory ordered [blocks, positions, heads, ...]). A block moves as bytes, and both sides share the layout."""
    order = sorted(range(block.ndim), key=block.stride, reverse=True)
    return block.permute(*order).is_contiguous()


def _regions(kv: torch.Tensor, num_blocks: int, name: str) -> list[Region]:
    """A layer's cache as NIXL regions: blocks on axis 0 (one region: each block K and V together), or on axis 1
    of a [2, num_blocks, ...] tensor (two regions, K and V); each block must be one dense span."""
    elsize = kv.element_size()
    if kv.shape[0] == num_blocks and _dense(kv[0]):
        return [Region(kv.data_ptr(), kv[0].numel() * elsize, kv.stride(0) * elsize, num_blocks)]
    if kv.ndim > 2 and kv.shape[0] == 2 and kv.shape[1] == num_blocks and _dense(kv[0, 0]):
        return [Region(kv[i].data_ptr(), kv[i, 0].numel() * elsize, kv.stride(1) * elsize, num_blocks) for i in (0, 1)]
    raise ValueError(f"the layerwise KV connector cannot lay out layer {name}'s cache {tuple(kv.shape)} "
                     f"strides {kv.stride()} ({num_blocks} blocks)")


def prep_blocks(nixl: Any, agent: str, regions: tuple[Region, ...], device_id: int,
                mem_type: str) -> tuple[Any, np.ndarray]:
    """A prepped descriptor list of every block of every region (row r's block b at offsets[r] + b): strided rows
    where this NIXL takes them, one descriptor per block otherwise."""
    counts = np.asarray([r.num_blocks for r in regions], dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    rows = np.asarray([(r.addr, r.block_bytes, device_id, r.stride, r.num_blocks) for r in regions], dtype=np.int64)
    try:
        return nixl.prep_xfer_dlist(agent, rows, mem_type), offsets
    except (TypeError, ValueError, AttributeError):  # a NIXL without strided lists (before 1.5): expand them
        flat = np.concatenate([np.stack([r.addr + np.arange(r.num_blocks, dtype=np.int64) * r.stride,
                                         np.full(r.num_blocks, r.block_bytes), np.full(r.num_blocks, device_id)],
                                        axis=1) for r in regions])
        return nixl.prep_xfer_dlist(agent, flat, mem_type), offsets


def fetch(endpoint: str, timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """A rank's `AgentInfo` bytes from its metadata server; RuntimeError when it does not answer in time."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", b"meta"])
        if not sock.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"no answer within {timeout_s:g} s")
        return sock.recv_multipart()[-1]
    finally:
        sock.close(linger=0)
