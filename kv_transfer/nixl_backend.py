"""KV transfer over NIXL (UCX underneath: shared memory / CMA on one host, cuda_ipc between GPUs, RDMA across
hosts). The sender WRITEs one layer's blocks (K and V in one request) into the receiver's registered KV memory
as soon as the layer is queued, with no notification and no wait; one notification per request and route
follows once every write completed. Descriptor lists are prepared once per peer (one strided row per layer and
K/V covering every block) and each transfer picks blocks by index, so no per-transfer key unpacking happens.

The sender's side of one request and route, what it posts and when it says so, is `nixl_channel.NixlChannel`.

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

import logging
import os
import threading
import time
from collections import Counter

import numpy as np

from splitserve.kv_transfer import staging
from splitserve.kv_transfer.errors import TransferError
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.nixl_channel import SPIN_S, NixlChannel
from splitserve.kv_transfer.shards import Route
from splitserve.kv_transfer.staging import STAGING_DEFAULT, StagingRing
from splitserve.kv_transfer.ticket import RankEndpoint, TransferTicket

log = logging.getLogger("splitserve.kv_transfer.nixl")

# idle backoff of the notification poller, seconds: doubles from MIN to MAX while nothing is expected; MAX
# bounds how long UCX goes unprogressed at rest (keepalives, a late abort notice). Each poll progresses UCX
# (~0.1-0.2 ms of CPU on a loaded 2-core box), so at 10 ms two idle agents cost ~3% of a core; at 50 ms, <1%
IDLE_MIN_S = 1e-3
IDLE_MAX_S = 50e-3
# bytes per descriptor of a run of blocks contiguous on both sides (rounded down to whole blocks, at least one);
# 0: runs are not cut. Between two H200s cutting did not pay: an 8B layer-wise request took 4.9 ms uncut into
# 4 MiB pieces, 5.6 ms into 1 MiB and 12.4 ms into 256 KiB, and a whole request in 1 MiB pieces 2.9 ms against
# 2.0 ms uncut (per-descriptor cost ~5 us, serial)
CHUNK_BYTES = int(os.environ.get("SPLITSERVE_NIXL_CHUNK_BYTES", "0"))
# UCX backend threads (NIXL's num_threads); 0: NIXL's default
THREADS = int(os.environ.get("SPLITSERVE_NIXL_THREADS", "0"))
MAX_SENDERS = 1024  # bound on a notice's sender rank and sender count


class NixlBackend:
    name = "nixl"
    one_sided = True  # senders write our memory; we learn only from their notices

    def __init__(self, agent_name: str, loopback_only: bool = False) -> None:
        if loopback_only and "UCX_NET_DEVICES" not in os.environ:
            # UCX's tcp transport listens on every network device by default (the host's external address
            # too); a worker bound to loopback has only same-host peers (shared memory, CMA, loopback tcp)
            os.environ["UCX_NET_DEVICES"] = "lo"
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
            if text.startswith("A|"):  # the sender aborted: it posts no more writes
                rid = text[2:]
                if agent.lookup(rid) is not None:
                    agent.fail(rid, TransferError(f"{rid}: sender aborted"))
                agent.sender_stopped(rid)
                return
            tag, layer, final, nbytes, src, num_src, rid = text.split("|", 6)
            if tag != "L":
                raise ValueError(f"unknown kind {tag!r}")
            ticket = agent.lookup(rid)
            if ticket is None:  # ended (cancelled, timed out) or never expected
                log.debug("nixl: notification for %r, not expected (any more)", rid[:80])
                if layer == "-1":  # the request's notice: that sender's writes all completed
                    agent.sender_stopped(rid)
                return
            layers = [-1] if layer == "-1" else [_count(x) for x in layer.split(",", ticket.num_layers)]
            nbytes, src, num_src = _count(nbytes), _count(src), _count(num_src)
            if not all(-1 <= x < ticket.num_layers for x in layers) or final not in ("0", "1"):
                raise ValueError("layer or final flag out of range")
            # every byte a request can bring here: each K and V block of each layer, every head of this rank, sent
            # again by each chunk of the prompt that ends inside it (at most once per token it holds)
            lay = agent.layout
            most = 2 * ticket.num_layers * len(ticket.block_ids) * lay.block_bytes * lay.block_size
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
        bb = layout.block_size * route.num_heads * layout.head_bytes  # bytes of one block of the route's heads
        if staged:
            ring = self.staging()
            local = ring.prep(bb, self.mem_type, self.dev_id)
        else:
            ring, local = None, self.local_prep(route.src_offset, route.num_heads, per_token)
        remote = self._remote_prep(ticket, rank, route.dst_offset, route.num_heads, per_token)
        if CHUNK_BYTES < 0:
            raise ValueError(f"SPLITSERVE_NIXL_CHUNK_BYTES must be 0 (no cut) or positive, got {CHUNK_BYTES}")
        chunk = max(1, CHUNK_BYTES // bb) if CHUNK_BYTES else 1 << 31  # blocks
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


def _count(field: str) -> int:
    """A non-negative decimal integer off the wire (no sign, spaces or underscores, at most 18 digits)."""
    if not (field.isascii() and field.isdigit() and len(field) <= 18):
        raise ValueError(f"not a count: {field[:20]!r}")
    return int(field)
