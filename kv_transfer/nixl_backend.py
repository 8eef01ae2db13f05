"""KV transfer over NIXL (UCX underneath: shared memory / CMA on one host, cuda_ipc between GPUs, RDMA across
hosts). The sender WRITEs coalesced block runs of one layer (K and V in one request) into the receiver's
registered KV memory; a NIXL notification per layer tells the receiver what landed. Descriptor lists are
prepared once per peer (one strided row per layer and K/V covering every block) and each transfer picks
blocks by index, so contiguous runs merge into single descriptors and no per-transfer key unpacking happens.

Sharded workers: a route that carries every head of both sides' shards moves whole blocks as above. One that
carries a slab of the sender's heads into a receiver holding exactly that slab (prefill TP=1 into decode TP=2)
is staged: the sender gathers the slab's blocks into a registered staging ring (one copy per layer and K/V),
then writes whole blocks from there, so the descriptors still merge into one per run. Written per token
instead, a 1024-token prompt of a 48-layer model is 2 x 1024 descriptors per layer and route, ~0.8 s of the
single sender thread per request on H200s (against ~5 ms whole), and 64 concurrent requests queue past
the receiver's deadline. Only a route strided on the receiver's side (it holds more heads than the slab:
prefill TP=2 into decode TP=1) still has one descriptor per token ([slab heads, head_dim] contiguous there).

Notification: b"L|<layer>|<final 0/1>|<bytes>|<sender rank>|<senders>|<request id>" (layer -1: every layer, one
transfer) or b"A|<request id>" (sender aborted).

Polling: NIXL has no blocking wait for notifications, and the UCX progress thread its Python agent starts
polls with a 0 µs delay (nixl 1.5.1's `nixl_agent` hard-wires `pthrDelay = 0`): a core spent forever. So the
agent runs without it and UCX progresses inside our own calls (`get_new_notifs`, `check_xfer_state`): every
SPIN_S while a transfer is expected or a write is in flight, otherwise with an idle backoff of
IDLE_MIN_S..IDLE_MAX_S that `KVTransferAgent.expect` cuts short.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

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
            enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self._agent = None
        self._reg = None
        self._remotes: set[str] = set()  # remote agents loaded
        self._preps: dict[tuple, object] = {}  # (agent or "", head offset, heads, per token) -> prepped dlist
        self._remote_lock = threading.Lock()
        self._closed = False
        self._notif_thread: threading.Thread | None = None
        self._staging: StagingRing | None = None  # made at the first staged route (senders of head slabs only)

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

    @staticmethod
    def _on_notif(agent, msg: bytes) -> None:
        try:
            text = msg.decode()
            if text.startswith("A|"):
                rid = text[2:]
                if agent.lookup(rid) is not None:
                    agent.fail(rid, TransferError(f"{rid}: sender aborted"))
                return
            tag, layer, final, nbytes, src, num_src, rid = text.split("|", 6)
            if tag != "L":
                raise ValueError(tag)
            ticket = agent.lookup(rid)
            if ticket is None or not -1 <= int(layer) < ticket.num_layers or final not in ("0", "1"):
                raise ValueError("unknown request or layer")
            agent.landed(rid, int(layer), (0, 1), final == "1", int(nbytes), int(src), int(num_src))
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
        return NixlChannel(self, ticket, route, rank.agent, local, remote, per_token, ring)

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


class NixlChannel:
    """Posts one WRITE per layer (or one for all layers) without waiting; `flush` waits for completion.

    A final write of a layer waits for that layer's earlier (non-final) writes first, so its notification
    never overtakes data of the same layer. A staged channel (`ring`) copies the slab's blocks into a ring slot
    before each write and frees the slot when the write is done; a layer's blocks go in writes of at most an
    eighth of the ring, so the ring always holds several.
    """

    def __init__(self, backend: NixlBackend, ticket: TransferTicket, route: Route, remote: str, local_prep,
                 remote_prep, per_token: bool, ring: StagingRing | None = None) -> None:
        self.b = backend
        self.ticket = ticket
        self.route = route
        self.remote = remote
        self.local_prep = local_prep
        self.remote_prep = remote_prep
        self.per_token = per_token
        self.ring = ring
        self.layout: KVLayout = backend._agent.layout
        self.bb = self.layout.block_size * route.num_heads * self.layout.head_bytes  # bytes of a block of the route
        self._inflight: list[tuple[object, int, _Slot | None]] = []  # (handle, layer tag, staging slot)

    def write_layer(self, layer: int, runs: list[tuple[int, int, int]], final: bool) -> int:
        parts = self._split(runs) if self.ring is not None else [runs]
        n = sum(self._post((layer,), part, False, layer) for part in parts[:-1])
        if final:
            self._wait(lambda tag: tag == layer)
        return n + self._post((layer,), parts[-1], final, layer)

    def write_all(self, runs: list[tuple[int, int, int]]) -> int:
        if self.ring is not None:  # the ring holds a few layers, not a whole prompt: layer by layer
            return sum(self.write_layer(layer, runs, True) for layer in range(self.layout.num_layers))
        self._wait(lambda tag: True)
        return self._post(range(self.layout.num_layers), runs, True, -1)

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

    def _post(self, layers, runs: list[tuple[int, int, int]], final: bool, tag: int) -> int:
        r = self.route
        bs, bb = self.layout.block_size, self.bb
        nbytes = 2 * len(layers) * sum(n for _, _, n in runs) * bb
        notif = f"L|{tag}|{int(final)}|{nbytes}|{r.src_rank}|{r.num_src}|{self.ticket.request_id}".encode()
        nx = self.b.nixl
        if not runs:
            if final:
                nx.send_notif(self.remote, notif)
            return 0
        # indices into the prepped lists: row (layer, kv) holds that tensor's blocks (or tokens) in order
        src = np.concatenate([np.arange(s, s + n) for s, _, n in runs])
        dst = np.concatenate([np.arange(d, d + n) for _, d, n in runs])
        local_n, remote_n = self.layout.num_blocks, self.ticket.num_blocks  # entries per row
        if self.per_token:
            tok = np.arange(bs)
            src = (src[:, None] * bs + tok[None, :]).reshape(-1)
            dst = (dst[:, None] * bs + tok[None, :]).reshape(-1)
            local_n, remote_n = local_n * bs, remote_n * bs
        rows = np.array([2 * layer + kv for layer in layers for kv in (0, 1)])
        remote = (rows[:, None] * remote_n + dst[None, :]).reshape(-1).astype(np.int32)
        slot = None
        if self.ring is None:
            local = (rows[:, None] * local_n + src[None, :]).reshape(-1).astype(np.int32)
        else:  # one layer: the slot holds its K blocks, then its V blocks, in the order of `remote`
            slot = self._stage(layers[0], src)
            local = (slot.start // bb + np.arange(2 * len(src))).astype(np.int32)
        try:
            handle = nx.make_prepped_xfer("WRITE", self.local_prep, local, self.remote_prep, remote, notif)
            state = nx.transfer(handle)
            if state == "ERR":
                nx.release_xfer_handle(handle)
                raise TransferError(f"{self.ticket.request_id}: NIXL refused the write of layer {tag}")
        except BaseException:
            self._give(slot)
            raise
        self._inflight.append((handle, tag, slot))
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
        nx = self.b.nixl
        still, failed = [], None
        for handle, tag, slot in self._inflight:
            state = nx.check_xfer_state(handle)
            if state in ("DONE", "ERR"):
                nx.release_xfer_handle(handle)
                self._give(slot)
                if state == "ERR" and failed is None:
                    failed = tag
            else:
                still.append((handle, tag, slot))
        self._inflight = still
        if failed is not None:
            raise TransferError(f"{self.ticket.request_id}: NIXL reported an error on layer {failed}")

    def _wait(self, which) -> None:
        spins = 0
        while any(which(tag) for _, tag, _ in self._inflight):
            if time.time() > self.ticket.deadline:
                raise TransferTimeout(f"{self.ticket.request_id}: writes not complete by the deadline")
            self._reap()
            spins += 1
            if spins > 64:  # poll gently after a short spin: on small hosts the receiver needs the core
                time.sleep(SPIN_S)

    def flush(self) -> None:
        self._wait(lambda tag: True)

    def poll(self) -> bool:
        """Progress in-flight writes (UCX moves only when asked); True while some are still in flight."""
        if self._inflight:
            self._reap()
        return bool(self._inflight)

    def abort(self) -> None:
        self.b.nixl.send_notif(self.remote, f"A|{self.ticket.request_id}".encode())

    def close(self) -> None:
        # a slot freed under a write still in flight can only change bytes bound for this failed request's blocks
        for handle, _, slot in self._inflight:
            try:
                self.b.nixl.release_xfer_handle(handle)
            except Exception:
                pass
            self._give(slot)
        self._inflight = []
