"""KV transfer over NIXL (UCX underneath: shared memory / CMA on one host, cuda_ipc between GPUs, RDMA across
hosts). The sender WRITEs coalesced block runs of one layer (K and V in one request) into the receiver's
registered KV memory; a NIXL notification per layer tells the receiver what landed. Descriptor lists are
prepared once per peer (one strided row per layer and K/V covering every block) and each transfer picks
blocks by index, so contiguous runs merge into single descriptors and no per-transfer key unpacking happens.

Notification: b"L|<layer>|<final 0/1>|<bytes>|<request id>" (layer -1: every layer, one transfer) or
b"A|<request id>" (sender aborted).

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

import numpy as np

from splitserve.kv_transfer.errors import TransferError, TransferTimeout
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.ticket import TransferTicket

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
        self._remotes: dict[str, tuple[str, object]] = {}  # ticket agent -> (NIXL remote name, prepped dlist)
        self._remote_lock = threading.Lock()
        self._closed = False
        self._notif_thread: threading.Thread | None = None

    def start(self, agent) -> None:
        self._agent = agent
        layout: KVLayout = agent.layout
        tensors = [t for kv in layout.tensors for t in kv]
        self._reg = self.nixl.register_memory(self.nixl.get_reg_descs(tensors))
        self.mem_type = "VRAM" if layout.is_cuda else "DRAM"
        self.dev_id = layout.device.index or 0
        self._metadata = self.nixl.get_agent_metadata()
        rows = [(t.data_ptr(), layout.block_bytes, self.dev_id, layout.block_bytes, layout.num_blocks) for t in tensors]
        self._local_prep = self.nixl.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(rows, dtype=np.int64), self.mem_type)
        self._notif_thread = threading.Thread(target=self._notif_loop, name="kv-nixl-notifs", daemon=True)
        self._notif_thread.start()

    def ticket_fields(self) -> dict:
        layout: KVLayout = self._agent.layout
        return {"nixl_metadata": self._metadata,
                "regions": [[k.data_ptr(), v.data_ptr()] for k, v in layout.tensors]}

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
            tag, layer, final, nbytes, rid = text.split("|", 4)
            if tag != "L":
                raise ValueError(tag)
            ticket = agent.lookup(rid)
            if ticket is None or not -1 <= int(layer) < ticket.num_layers or final not in ("0", "1"):
                raise ValueError("unknown request or layer")
            agent.landed(rid, int(layer), (0, 1), final == "1", int(nbytes))
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("nixl: ignoring malformed notification %r: %s", msg[:80], e)

    def _remote(self, ticket: TransferTicket) -> tuple[str, object]:
        with self._remote_lock:
            entry = self._remotes.get(ticket.agent)
            if entry is None:
                name = self.nixl.add_remote_agent(ticket.nixl_metadata)
                name = name.decode() if isinstance(name, bytes) else name
                if name != ticket.agent:
                    raise TransferError(f"ticket names agent {ticket.agent!r}, its metadata {name!r}")
                bb = ticket.block_bytes
                rows = [(addr, bb, ticket.device_id, bb, ticket.num_blocks) for kv in ticket.regions for addr in kv]
                prep = self.nixl.prep_xfer_dlist(name, np.array(rows, dtype=np.int64), ticket.mem_type)
                entry = self._remotes[ticket.agent] = (name, prep)
            return entry

    def open_channel(self, ticket: TransferTicket) -> NixlChannel:
        name, prep = self._remote(ticket)
        return NixlChannel(self, ticket, name, prep)

    def close(self) -> None:
        self._closed = True
        if self._notif_thread is not None:  # at most one idle sleep (IDLE_MAX_S) away from seeing `_closed`
            self._notif_thread.join(timeout=1.0)
        with self._remote_lock:
            for name, _ in self._remotes.values():
                try:
                    self.nixl.remove_remote_agent(name)
                except Exception:
                    pass
            self._remotes.clear()
        if self._reg is not None:
            try:
                self.nixl.deregister_memory(self._reg)
            except Exception:
                pass
            self._reg = None


class NixlChannel:
    """Posts one WRITE per layer (or one for all layers) without waiting; `flush` waits for completion.

    A final write of a layer waits for that layer's earlier (non-final) writes first, so its notification
    never overtakes data of the same layer.
    """

    def __init__(self, backend: NixlBackend, ticket: TransferTicket, remote: str, remote_prep) -> None:
        self.b = backend
        self.ticket = ticket
        self.remote = remote
        self.remote_prep = remote_prep
        self.layout: KVLayout = backend._agent.layout
        self._inflight: list[tuple[object, int]] = []  # (handle, layer tag)

    def write_layer(self, layer: int, runs: list[tuple[int, int, int]], final: bool) -> int:
        if final:
            self._wait(lambda tag: tag == layer)
        return self._post((layer,), runs, final, layer)

    def write_all(self, runs: list[tuple[int, int, int]]) -> int:
        self._wait(lambda tag: True)
        return self._post(range(self.layout.num_layers), runs, True, -1)

    def _post(self, layers, runs: list[tuple[int, int, int]], final: bool, tag: int) -> int:
        bb = self.layout.block_bytes
        nbytes = 2 * len(layers) * sum(n for _, _, n in runs) * bb
        notif = f"L|{tag}|{int(final)}|{nbytes}|{self.ticket.request_id}".encode()
        nx = self.b.nixl
        if not runs:
            if final:
                nx.send_notif(self.remote, notif)
            return 0
        # block-level indices into the prepped lists: row (layer, kv) holds that tensor's blocks in order
        src = np.concatenate([np.arange(s, s + n) for s, _, n in runs])
        dst = np.concatenate([np.arange(d, d + n) for _, d, n in runs])
        rows = np.array([2 * layer + kv for layer in layers for kv in (0, 1)])
        local = (rows[:, None] * self.layout.num_blocks + src[None, :]).reshape(-1).astype(np.int32)
        remote = (rows[:, None] * self.ticket.num_blocks + dst[None, :]).reshape(-1).astype(np.int32)
        handle = nx.make_prepped_xfer("WRITE", self.b._local_prep, local, self.remote_prep, remote, notif)
        state = nx.transfer(handle)
        if state == "ERR":
            nx.release_xfer_handle(handle)
            raise TransferError(f"{self.ticket.request_id}: NIXL refused the write of layer {tag}")
        self._inflight.append((handle, tag))
        self._reap()
        return nbytes

    def _reap(self) -> None:
        nx = self.b.nixl
        still = []
        for handle, tag in self._inflight:
            state = nx.check_xfer_state(handle)
            if state == "ERR":
                nx.release_xfer_handle(handle)
                raise TransferError(f"{self.ticket.request_id}: NIXL reported an error on layer {tag}")
            if state == "DONE":
                nx.release_xfer_handle(handle)
            else:
                still.append((handle, tag))
        self._inflight = still

    def _wait(self, which) -> None:
        spins = 0
        while any(which(tag) for _, tag in self._inflight):
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
        for handle, _ in self._inflight:
            try:
                self.b.nixl.release_xfer_handle(handle)
            except Exception:
                pass
        self._inflight = []
