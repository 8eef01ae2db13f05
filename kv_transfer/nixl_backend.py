"""KV transfer over NIXL (UCX underneath: shared memory / CMA on one host, cuda_ipc between GPUs, RDMA across
hosts). The sender WRITEs one layer's blocks (K and V in one request) into the receiver's registered KV memory
as soon as the layer is queued, with no notification and no wait; one notification per request and route
follows once every write completed. Descriptor lists are prepared once per peer (one strided row per layer and
K/V covering every block) and each transfer picks blocks by index, so no per-transfer key unpacking happens.

Descriptors: NIXL merges entries contiguous on both sides, and UCX serves one descriptor with one copy stream (a
403 MB region as one descriptor: 73 GB/s between two H200s). So a run of blocks contiguous on both sides is cut
into descriptors of CHUNK_BYTES, K and V alternating, and a layer has several in flight.

Notifications: a notified NIXL write flushes the endpoint before its notice goes, so a notice per layer
serialized the layers (82 GB/s layer-wise against 200 GB/s whole between two H200s). Writes carry none; the
sender tracks their completion and sends the request's notice itself (`NixlChannel._notify`).

Sharded workers: a route that carries every head of both sides' shards moves whole blocks as above. One that
carries a slab of the sender's heads into a receiver holding exactly that slab (prefill TP=1 into decode TP=2)
is staged: the sender gathers the slab's blocks into a registered staging ring (one copy per layer and K/V),
then writes whole blocks from there, so the descriptors still merge into one per chunk. Written per token
instead, a 1024-token prompt of a 48-layer model is 2 x 1024 descriptors per layer and route, ~0.8 s of the
single sender thread per request on H200s (against ~5 ms whole), and 64 concurrent requests queue past
the receiver's deadline. Only a route strided on the receiver's side (it holds more heads than the slab:
prefill TP=2 into decode TP=1) still has one descriptor per token ([slab heads, head_dim] contiguous there).

Notification: b"L|<layers>|<final 0/1>|<bytes>|<sender rank>|<senders>|<request id>": layers -1, the
request's notice, says every layer is final and in place; otherwise a progress notice names layers (comma
separated) whose final writes are in place; bytes are those landed since the sender's previous notice.
b"A|<request id>": the sender aborted.

Polling: NIXL has no blocking wait for notifications, and the UCX progress thread its Python agent starts
polls with a 0 µs delay (nixl 1.5.1's `nixl_agent` hard-wires `pthrDelay = 0`): a core spent forever. So the
agent runs without it and UCX progresses inside our own calls (`get_new_notifs`, `check_xfer_state`): every
SPIN_S while a transfer is expected or a write is in flight, otherwise with an idle backoff of
IDLE_MIN_S..IDLE_MAX_S that `KVTransferAgent.expect` cuts short.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.kv_transfer import staging
from splitserve.kv_transfer.errors import TransferError, TransferTimeout
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.shards import Route
from splitserve.kv_transfer.staging import STAGING_DEFAULT, StagingRing, _Slot
from splitserve.kv_transfer.ticket import RankEndpoint, TransferTicket

log = logging.getLogger("splitserve.kv_transfer.nixl")

# seconds between polls while a transfer is expected (receiver) or a write is in flight (sender)
SPIN_S = float(os.environ.get("SPLITSERVE_KV_POLL_US", "50")) * 1e-6
# idle backoff of the notification poller, seconds: doubles from MIN to MAX while nothing is expected; MAX
# bounds how long UCX goes unprogressed at rest (keepalives, a late abort notice)
IDLE_MIN_S = 1e-3
IDLE_MAX_S = 10e-3
# bytes per descriptor of a run of blocks contiguous on both sides (rounded down to whole blocks, at least one);
# 0: runs are not cut. Between two H200s cutting did not pay: an 8B layer-wise request took 4.9 ms uncut into
# 4 MiB pieces, 5.6 ms into 1 MiB and 12.4 ms into 256 KiB, and a whole request in 1 MiB pieces 2.9 ms against
# 2.0 ms uncut (per-descriptor cost ~5 us, serial)
CHUNK_BYTES = int(os.environ.get("SPLITSERVE_NIXL_CHUNK_BYTES", "0"))
# UCX backend threads (NIXL's num_threads); 0: NIXL's default
THREADS = int(os.environ.get("SPLITSERVE_NIXL_THREADS", "0"))
# seconds between a channel's progress notices; 0: none, only the request's notice. A request landing within
# this long sends one notice per route.
PROGRESS_S = float(os.environ.get("SPLITSERVE_KV_PROGRESS_MS", "5")) * 1e-3
MAX_SENDERS = 1024  # bound on a notice's sender rank and sender count


class NixlBackend:
    name = "nixl"

    def __init__(self, agent_name: str) -> None:
        # raises ImportError where NIXL is absent
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        # NIXL logs INFO lines to stdout; route its logger through ours (stderr, warnings and up)
        nixl_log = logging.getLogger("nixl")
        nixl_log.handlers.clear()
        nixl_log.propagate = True
        nixl_log.setLevel(logging.WARNING)
        # No progress thread (it spins, see the module docstring). We call NIXL from the notification, sender
        # and caller threads, and without that thread UCX progresses inside whichever call is running: STRICT
        # serializes every agent call, so two of them never progress the worker (and append notifications)
        # at once. The calls are short, except a post that copies over CMA, which a receiver waits out anyway.
        self.nixl = nixl_agent(agent_name, nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            num_threads=THREADS))
        self._agent = None
        self._reg = None
        self._remotes: set[str] = set()  # remote agents loaded
        self._preps: dict[tuple, object] = {}  # (agent or "", head offset, heads, per token) -> prepped dlist
        self._remote_lock = threading.Lock()
        self._closed = False
        self._notif_thread: threading.Thread | None = None
        self._staging: StagingRing | None = None  # made at the first staged route (senders of head slabs only)
        # sent: "xfers" (NIXL write requests), "descs" (descriptors in them), "notifs"; received: "notifs"
        self.counts: Counter[str] = Counter()

    def start(self, agent) -> None:
        self._agent = agent
        layout: KVLayout = agent.layout
        tensors = [t for kv in layout.tensors for t in kv]
        self._reg = self.nixl.register_memory(self.nixl.get_reg_descs(tensors))
        self.mem_type = "VRAM" if layout.is_cuda else "DRAM"
        self.dev_id = layout.device.index or 0
        self._metadata = self.nixl.get_agent_metadata()
        self._local_prep = self.local_prep(0, layout.num_heads, False)
        self._notif_thread = threading.Thread(target=self._notif_loop, name="kv-nixl-notifs", daemon=True)
        self._notif_thread.start()

    def endpoint_fields(self) -> dict:
        layout: KVLayout = self._agent.layout
        return {"nixl_metadata": self._metadata,
                "regions": [[k.data_ptr(), v.data_ptr()] for k, v in layout.tensors]}

    @staticmethod
    def _rows(addrs: list[int], heads: int, offset: int, count: int, head_bytes: int, block_size: int,
              num_blocks: int, dev: int, per_token: bool) -> np.ndarray:
        """Strided rows (address, len, device, stride, count), one per tensor: whole blocks, or per token the
        slab of `count` heads from `offset` of a shard of `heads` heads."""
        if per_token:
            rows = [(a + offset * head_bytes, count * head_bytes, dev, heads * head_bytes, num_blocks * block_size)
                    for a in addrs]
        else:
            bb = block_size * heads * head_bytes
            rows = [(a, bb, dev, bb, num_blocks) for a in addrs]
        return np.array(rows, dtype=np.int64)

    def local_prep(self, offset: int, count: int, per_token: bool):
        key = ("", offset, count, per_token)
        with self._remote_lock:
            prep = self._preps.get(key)
            if prep is None:
                lay: KVLayout = self._agent.layout
                addrs = [t.data_ptr() for kv in lay.tensors for t in kv]
                rows = self._rows(addrs, lay.num_heads, offset, count, lay.head_bytes, lay.block_size,
                                  lay.num_blocks, self.dev_id, per_token)
                prep = self._preps[key] = self.nixl.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self.mem_type)
            return prep

    def _notif_loop(self) -> None:
        """Hand notifications to the agent. Each `get_new_notifs` also progresses UCX (no progress thread).

        Polls every SPIN_S while the agent expects a transfer (so a landed layer is seen within ~SPIN_S);
        at rest it sleeps IDLE_MIN_S, doubling up to IDLE_MAX_S, and `expect()` wakes it at once.
        """
        agent = self._agent
        idle_s = 0.0  # current idle sleep, seconds (0: spinning)
        while not self._closed:
            try:
                notifs = self.nixl.get_new_notifs()
            except Exception as e:  # the agent is shutting down
                log.debug("nixl notif poll failed: %s", e)
                return
            got = False
            for msgs in notifs.values():
                for msg in msgs:
                    got = True
                    self._on_notif(agent, msg)
            if got:
                idle_s = 0.0
            elif agent.num_pending:
                idle_s = 0.0
                time.sleep(SPIN_S)
            else:
                idle_s = min(IDLE_MAX_S, max(IDLE_MIN_S, 2 * idle_s))
                if agent.wait_for_pending(idle_s):
                    idle_s = 0.0

    def _on_notif(self, agent, msg: bytes) -> None:
        """Account one notice; every field is checked against the request it names, a bad one is logged and
        dropped (it can only leave that request to its deadline)."""
        self.counts["notifs_received"] += 1
        try:
            text = msg.decode("ascii")
            if text.startswith("A|"):
                rid = text[2:]
                if agent.lookup(rid) is not None:
                    agent.fail(rid, TransferError(f"{rid}: sender aborted"))
                return
            tag, layer, final, nbytes, src, num_src, rid = text.split("|", 6)
            if tag != "L":
                raise ValueError(f"unknown kind {tag!r}")
            ticket = agent.lookup(rid)
            if ticket is None:  # ended (cancelled, timed out) or never expected
                log.debug("nixl: notification for %r, not expected (any more)", rid[:80])
                return
            layers = [-1] if layer == "-1" else [_count(x) for x in layer.split(",", ticket.num_layers)]
            nbytes, src, num_src = _count(nbytes), _count(src), _count(num_src)
            if not all(-1 <= x < ticket.num_layers for x in layers) or final not in ("0", "1"):
                raise ValueError("layer or final flag out of range")
            # every byte a request can bring here: each K and V block of each layer, every head of this rank
            most = 2 * ticket.num_layers * len(ticket.block_ids) * agent.layout.block_bytes
            if nbytes > most or src >= MAX_SENDERS or not 1 <= num_src <= MAX_SENDERS:
                raise ValueError("bytes or sender out of range")
            for i, x in enumerate(layers):  # the bytes count once
                agent.landed(rid, x, (0, 1), final == "1", 0 if i else nbytes, src, num_src)
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("nixl: ignoring malformed notification %r: %s", msg[:80], e)

    def _remote_prep(self, ticket: TransferTicket, rank: RankEndpoint, offset: int, count: int, per_token: bool):
        key = (rank.agent, offset, count, per_token)
        with self._remote_lock:
            prep = self._preps.get(key)
            if prep is not None:
                return prep
            if rank.agent not in self._remotes:
                name = self.nixl.add_remote_agent(rank.nixl_metadata)
                name = name.decode() if isinstance(name, bytes) else name
                if name != rank.agent:
                    raise TransferError(f"ticket names agent {rank.agent!r}, its metadata {name!r}")
                self._remotes.add(name)
            addrs = [addr for kv in rank.regions for addr in kv]
            head_bytes = ticket.head_dim * ticket.itemsize
            rows = self._rows(addrs, rank.num_heads, offset, count, head_bytes, ticket.block_size, ticket.num_blocks,
                              rank.device_id, per_token)
            prep = self._preps[key] = self.nixl.prep_xfer_dlist(rank.agent, rows, rank.mem_type)
            return prep

    def staging(self) -> StagingRing:
        with self._remote_lock:
            if self._staging is None:
                layout: KVLayout = self._agent.layout
                size = staging.STAGING_BYTES or STAGING_DEFAULT["cuda" if layout.is_cuda else "cpu"]
                self._staging = StagingRing(self.nixl, layout, size)
            return self._staging

    def open_channel(self, ticket: TransferTicket, route: Route) -> NixlChannel:
        rank = ticket.ranks[route.dst_rank]
        layout: KVLayout = self._agent.layout
        # whole blocks when the receiver holds exactly the route's heads (from the KV itself when we do too, else
        # staged); one descriptor per token when the receiver holds more
        per_token = route.num_heads != rank.num_heads
        staged = not per_token and route.num_heads != layout.num_heads
        if staged:
            ring = self.staging()
            bb = layout.block_size * route.num_heads * layout.head_bytes  # bytes of one block of the slab
            local = ring.prep(bb, self.mem_type, self.dev_id)
        else:
            ring, local = None, self.local_prep(route.src_offset, route.num_heads, per_token)
        remote = self._remote_prep(ticket, rank, route.dst_offset, route.num_heads, per_token)
        if CHUNK_BYTES < 0:
            raise ValueError(f"SPLITSERVE_NIXL_CHUNK_BYTES must be 0 (no cut) or positive, got {CHUNK_BYTES}")
        block_bytes = layout.block_size * route.num_heads * layout.head_bytes
        chunk = max(1, CHUNK_BYTES // block_bytes) if CHUNK_BYTES else 1 << 31  # blocks
        return NixlChannel(self, ticket, route, rank.agent, local, remote, per_token, ring, chunk)

    def close(self) -> None:
        self._closed = True
        if self._notif_thread is not None:  # at most one idle sleep (IDLE_MAX_S) away from seeing `_closed`
            self._notif_thread.join(timeout=1.0)
        with self._remote_lock:
            for name in self._remotes:
                try:
                    self.nixl.remove_remote_agent(name)
                except Exception:
                    pass
            self._remotes.clear()
            self._preps.clear()
            if self._staging is not None:
                self._staging.close()
                self._staging = None
        if self._reg is not None:
            try:
                self.nixl.deregister_memory(self._reg)
            except Exception:
                pass
            self._reg = None


@dataclass
class _Indices:
    """One layer's entries of a channel's runs, in write order (layer 0's rows; layer l adds 2 * l rows)."""

    local: np.ndarray  # [2 * entries] into the sender's prepped list (K entries, V entries, interleaved by chunk)
    remote: np.ndarray  # the same into the receiver's
    staged: np.ndarray  # the same into a ring slot holding the runs' K blocks, then their V blocks
    src: np.ndarray  # the sender's block ids, in run order
    local_row: int  # entries per row (a layer's K or V) of the prepped lists
    remote_row: int
    descs: int  # descriptors of one layer after NIXL's merging
    nbytes: int  # bytes of one layer


def _count(field: str) -> int:
    """A non-negative decimal integer off the wire (no sign, spaces or underscores, at most 18 digits)."""
    if not (field.isascii() and field.isdigit() and len(field) <= 18):
        raise ValueError(f"not a count: {field[:20]!r}")
    return int(field)


class NixlChannel:
    """Posts each layer's writes (or every layer's, `write_all`) at once, without a notification and without
    waiting; one notice per request and route follows once every layer's final write was posted and every write
    of the request completed locally, so the notice never overtakes data (`_notify`). While writes are slow to
    land (a paced prefill), a progress notice per landed layer goes at most every PROGRESS_S, never on a write.

    Runs contiguous on both sides are written in descriptors of `chunk` blocks (`_indices`). A staged channel
    (`ring`) copies the slab's blocks into a ring slot before each write and frees the slot only once NIXL
    reports that write done; a layer's blocks go in writes of at most an eighth of the ring, so the ring always
    holds several.
    """

    def __init__(self, backend: NixlBackend, ticket: TransferTicket, route: Route, remote: str, local_prep,
                 remote_prep, per_token: bool, ring: StagingRing | None = None, chunk: int = 1) -> None:
        self.b = backend
        self.ticket = ticket
        self.route = route
        self.remote = remote
        self.local_prep = local_prep
        self.remote_prep = remote_prep
        self.per_token = per_token
        self.ring = ring
        self.chunk = chunk  # blocks per descriptor of a run contiguous on both sides
        self.layout: KVLayout = backend._agent.layout
        self.bb = self.layout.block_size * route.num_heads * self.layout.head_bytes  # bytes of a block of the route
        # writes not yet done, in post order: (handle, sequence number, bytes, staging slot)
        self._inflight: deque[tuple[object, int, int, _Slot | None]] = deque()
        self._seq = 0  # writes posted so far
        self._finals: deque[tuple[int, int]] = deque()  # (writes posted up to its final write, layer), not yet landed
        self._final_layers: set[int] = set()  # layers whose final write was posted
        self._landed: list[int] = []  # layers landed, not yet in a notice
        self._done_bytes = 0  # bytes of completed writes not yet in a notice
        self._last_notice = time.monotonic()
        self._notified = False  # the request's notice went out
        self._cache: list[tuple[list[tuple[int, int, int]], _Indices]] = []  # the latest runs' indices

    def write_layer(self, layer: int, runs: list[tuple[int, int, int]], final: bool) -> int:
        parts = self._split(runs) if self.ring is not None else [runs]
        n = sum(self._post((layer,), part) for part in parts)
        if final:
            self._mark_final((layer,))
        return n

    def write_all(self, runs: list[tuple[int, int, int]]) -> int:
        if self.ring is not None:  # the ring holds a few layers, not a whole prompt: layer by layer
            return sum(self.write_layer(layer, runs, True) for layer in range(self.layout.num_layers))
        n = self._post(range(self.layout.num_layers), runs)
        self._mark_final(range(self.layout.num_layers))
        return n

    def _mark_final(self, layers) -> None:
        for layer in layers:
            self._final_layers.add(layer)
            self._finals.append((self._seq, layer))
        self._notify()

    def _split(self, runs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
        """`runs` cut into parts of at most an eighth of the ring each (counting K and V)."""
        cap = max(1, self.ring.size // (16 * self.bb))  # blocks per part
        parts: list[list[tuple[int, int, int]]] = [[]]
        n = 0
        for s, d, k in runs:
            while k:
                if n == cap:
                    parts.append([])
                    n = 0
                take = min(k, cap - n)
                parts[-1].append((s, d, take))
                n, s, d, k = n + take, s + take, d + take, k - take
        return parts

    def _indices(self, runs: list[tuple[int, int, int]]) -> _Indices:
        """Where layer 0's K and V blocks of `runs` are in the prepped lists, in write order. Every layer's writes
        name the same runs, so the latest runs' indices are kept and later layers only shift them.

        NIXL merges entries adjacent in a request that are contiguous on both sides, so a run would become one
        descriptor per tensor, served by one copy stream. Taking each run `chunk` blocks of K, then the same of
        V, and so on cuts it into descriptors of `chunk` blocks: a layer has several in flight.
        """
        for cached, idx in self._cache:
            if cached == runs:
                return idx
        a = np.fromiter(itertools.chain.from_iterable(runs), dtype=np.int64, count=3 * len(runs)).reshape(-1, 3)
        n = a[:, 2]
        first = np.cumsum(n) - n  # position of each run's first block
        pos = np.arange(int(n.sum())) - np.repeat(first, n)  # position within its run
        src, dst = np.repeat(a[:, 0], n) + pos, np.repeat(a[:, 1], n) + pos  # block ids
        local_n, remote_n = self.layout.num_blocks, self.ticket.num_blocks  # entries per row
        if self.per_token:  # one entry per token, never contiguous on the receiver's side: plain order
            bs = self.layout.block_size
            tok = np.arange(bs)
            lsrc = (src[:, None] * bs + tok[None, :]).reshape(-1)
            ldst = (dst[:, None] * bs + tok[None, :]).reshape(-1)
            local_n, remote_n = local_n * bs, remote_n * bs
            order, descs = np.arange(2 * len(lsrc)), 2 * len(lsrc)
        else:
            lsrc, ldst = src, dst
            chunks = -(-n // self.chunk)  # per run
            chunk_id = np.repeat(np.cumsum(chunks) - chunks, n) + pos // self.chunk
            order = np.argsort((2 * chunk_id[None, :] + np.arange(2)[:, None]).reshape(-1), kind="stable")
            descs = 2 * int(chunks.sum())
        kv = np.arange(2)[:, None]
        idx = _Indices(
            local=(kv * local_n + lsrc).reshape(-1)[order], remote=(kv * remote_n + ldst).reshape(-1)[order],
            staged=order, src=src, local_row=local_n, remote_row=remote_n, descs=descs,
            nbytes=2 * len(src) * self.bb)
        self._cache = [(list(runs), idx), *self._cache[:3]]  # a staged layer's few parts, or a step's runs
        return idx

    def _post(self, layers, runs: list[tuple[int, int, int]]) -> int:
        if self._notified:
            raise TransferError(f"{self.ticket.request_id}: a write after the request's final notice")
        if not runs:
            return 0
        idx = self._indices(runs)
        shift = 2 * np.asarray(layers, dtype=np.int64)[:, None]  # rows of each layer's K: [layers, 1]
        remote = (shift * idx.remote_row + idx.remote).reshape(-1).astype(np.int32)
        slot = None
        if self.ring is None:
            local = (shift * idx.local_row + idx.local).reshape(-1).astype(np.int32)
        else:  # one layer: the slot holds its K blocks, then its V blocks, in the order of the runs
            slot = self._stage(layers[0], idx.src)
            local = (slot.start // self.bb + idx.staged).astype(np.int32)
        nx = self.b.nixl
        try:
            handle = nx.make_prepped_xfer("WRITE", self.local_prep, local, self.remote_prep, remote)
            state = nx.transfer(handle)
            if state == "ERR":
                nx.release_xfer_handle(handle)
                raise TransferError(f"{self.ticket.request_id}: NIXL refused the write of layer {layers[0]}")
        except BaseException:
            self._give(slot)
            raise
        nbytes = idx.nbytes * len(layers)
        self._inflight.append((handle, self._seq, nbytes, slot))
        self._seq += 1
        self.b.counts["xfers"] += 1
        self.b.counts["descs"] += idx.descs * len(layers)
        self._reap()
        return nbytes

    def _stage(self, layer: int, src: np.ndarray) -> _Slot:
        """Copy the route's heads of blocks `src` (K, then V) into a ring slot: [2, n, block_size, heads, dim]."""
        r, lay, n = self.route, self.layout, len(src)
        slot = self._take(2 * n * self.bb)
        try:
            stream = self.ring.stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                idx = torch.as_tensor(src, device=lay.device)
                out = self.ring.buf[slot.start : slot.end].view(lay.tensors[0][0].dtype)
                out = out.view(2, n, lay.block_size, r.num_heads, lay.head_dim)
                for kv in (0, 1):
                    torch.index_select(lay.heads_view(layer, kv, r.src_offset, r.num_heads), 0, idx, out=out[kv])
            if stream is not None:
                stream.synchronize()  # the copy is in the ring before NIXL reads it
        except BaseException:
            self._give(slot)
            raise
        return slot

    def _take(self, nbytes: int) -> _Slot:
        """A ring slot, progressing this agent's in-flight writes (which hold the rest of the ring) until one frees."""
        spins = 0
        while (slot := self.ring.take(nbytes, self.bb)) is None:
            if time.time() > self.ticket.deadline:
                raise TransferTimeout(f"{self.ticket.request_id}: no staging space by the deadline")
            self._reap()
            self.b._agent.poll_sends()
            spins += 1
            if spins > 64:
                time.sleep(SPIN_S)
        return slot

    def _give(self, slot: _Slot | None) -> None:
        if self.ring is not None:
            self.ring.give(slot)

    def _reap(self) -> None:
        """Release completed writes (and their ring slots), oldest first, stopping at the first still in flight
        (writes complete about in order; checking every one on each post made a layer-wise request's checks
        quadratic in its layers), then send whatever notice is due."""
        nx = self.b.nixl
        failed = None
        while self._inflight:
            handle, seq, nbytes, slot = self._inflight[0]
            state = nx.check_xfer_state(handle)
            if state not in ("DONE", "ERR"):
                break
            self._inflight.popleft()
            nx.release_xfer_handle(handle)
            self._give(slot)
            self._done_bytes += nbytes
            if state == "ERR":
                failed = seq
                break
        if failed is not None:
            raise TransferError(f"{self.ticket.request_id}: NIXL reported an error on write {failed} to "
                                f"{self.remote}")
        self._notify()

    def _notify(self) -> None:
        """The request's notice once every layer's final write is posted and every write completed locally
        (NIXL's DONE: the bytes are in the receiver's memory); before that, progress notices for landed layers."""
        if self._notified:
            return
        r = self.route
        tail = f"{r.src_rank}|{r.num_src}|{self.ticket.request_id}"
        if not self._inflight and len(self._final_layers) == self.layout.num_layers:
            self._send(f"L|-1|1|{self._done_bytes}|{tail}")
            self._notified = True
            self._landed.clear()
            return
        done_through = self._inflight[0][1] if self._inflight else self._seq  # every write before it is done
        while self._finals and self._finals[0][0] <= done_through:
            self._landed.append(self._finals.popleft()[1])
        if not self._landed or PROGRESS_S <= 0 or time.monotonic() - self._last_notice < PROGRESS_S:
            return
        self._send(f"L|{','.join(map(str, self._landed))}|1|{self._done_bytes}|{tail}")
        self._done_bytes = 0
        self._landed.clear()
        self._last_notice = time.monotonic()

    def _send(self, notice: str) -> None:
        self.b.nixl.send_notif(self.remote, notice.encode())
        self.b.counts["notifs"] += 1

    def _wait(self) -> None:
        spins = 0
        while self._inflight:
            if time.time() > self.ticket.deadline:
                raise TransferTimeout(f"{self.ticket.request_id}: writes not complete by the deadline")
            self._reap()
            spins += 1
            if spins > 64:  # poll gently after a short spin: on small hosts the receiver needs the core
                time.sleep(SPIN_S)

    def flush(self) -> None:
        """Wait until every write completed (and the request's notice went out, if every layer was final)."""
        self._wait()
        self._notify()

    def poll(self) -> bool:
        """Progress in-flight writes (UCX moves only when asked); True while some are still in flight or a
        progress notice waits for its turn."""
        if self._inflight or self._landed:
            self._reap()
        return bool(self._inflight or self._landed)

    def abort(self) -> None:
        self.b.nixl.send_notif(self.remote, f"A|{self.ticket.request_id}".encode())

    def close(self) -> None:
        # a slot freed under a write still in flight can only change bytes bound for this failed request's blocks
        for handle, _, _, slot in self._inflight:
            try:
                self.b.nixl.release_xfer_handle(handle)
            except Exception:
                pass
            self._give(slot)
        self._inflight = deque()
