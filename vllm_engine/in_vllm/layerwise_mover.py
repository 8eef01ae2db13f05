"""The layer-wise push connector's worker side (each of vLLM's model-runner processes): it moves the KV.

One NIXL agent per rank over this rank's KV cache (`layerwise_peers.LocalKV`, with the decode ranks it writes to,
`Peers`), and one thread (`_run`) that makes every NIXL call:

- Prefill side (producers): each step the forward thread queues which requests the step computes (`begin_step`),
  then each layer as its KV is written (`layer_saved`; on a GPU with a CUDA event recorded after it, which the
  mover waits for), then the step's end. For a request whose ticket is in, each layer (or group of `layer_group`
  layers) is one NIXL WRITE of its blocks computed so far into the decode server's reserved blocks, posted while
  the forward goes on; layers computed before the ticket came go at once when it comes. Once every layer of the
  whole prompt was posted and every write completed (NIXL's DONE: the bytes are in the receiver's memory), one
  notification says so (`done_notice`). A write that fails, a decode rank that cannot be reached or the ticket's
  deadline ends the transfer with an `abort_notice` once no write of it is in flight. The request's blocks are
  held (vLLM's `request_finished` said so) until the transfer is over, or, without a ticket, until
  `ticket_wait_seconds` after the request finished (or the worker said the ticket will not come).
- Decode side (consumers): a reservation waits for its sender's notice. `done` lands it; `abort`, the worker's
  `release` (its ticket was never published) or the ticket's deadline plus `GRACE_S` (no sender posts after the
  deadline) fails it, and its blocks are reported as failed loads, so vLLM recomputes them (`kv_load_failure_policy:
  recompute`); either way the request is reported finished receiving, never waited on forever.

Where UCX says which transport it picked (`ucx_transport`), the first transfer to a peer reports it to the worker
beside vLLM; a dropped peer is reported too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from splitserve.vllm_engine.in_vllm.control_link import ControlLink
from splitserve.vllm_engine.in_vllm.layerwise_peers import LocalKV, Peer, Peers
from splitserve.vllm_engine.in_vllm.layerwise_plan import LayerwiseStepPlan, ProducerPlan
from splitserve.vllm_engine.in_vllm.layerwise_wire import (
    LayerwiseSettings,
    LayerwiseTicket,
    WireError,
    abort_notice,
    done_notice,
    now,
    parse_notice,
)
from splitserve.vllm_engine.in_vllm.ucx_transport import UcxLog

log = logging.getLogger("splitserve.vllm_layerwise")

# seconds between polls while a write is in flight or a reservation waits (UCX progresses only inside our calls)
SPIN_S = float(os.environ.get("SPLITSERVE_VLLM_KV_POLL_US", "0")) * 1e-6 or None
IDLE_MAX_S = 0.05  # the poll's backoff at rest
GRACE_S = 2.0  # after a ticket's deadline, for a write posted just before it to land
EARLY_KEEP_S = 120.0  # a notice or release that came before its reservation is kept this long
IDLE_WAIT_S = 0.01  # an engine step without a forward waits this long for a transfer to end


@dataclass
class _Producer:
    key: str
    req_id: str | None = None
    block_ids: tuple[int, ...] = ()
    num_prompt: int = 0
    computed: int = 0  # tokens whose KV is in this rank's cache for every layer
    ticket: LayerwiseTicket | None = None
    peer: Peer | None = None
    sent: list[int] = field(default_factory=list)  # per layer: tokens posted (or not needed) so far
    inflight: deque = field(default_factory=deque)  # (handle, bytes)
    bytes_done: int = 0
    failed: str = ""  # why the transfer stopped (no more writes)
    over: bool = False  # nothing of it is in flight or will be posted any more
    finished: bool = False  # vLLM finished the request (its blocks wait for us)
    dropped: bool = False  # its ticket will not come
    created: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0
    reported: bool = False  # its req id went to vLLM as finished sending


@dataclass
class _Consumer:
    req_id: str
    key: str
    block_ids: tuple[int, ...]
    deadline: float


class LayerwiseMover:
    def __init__(self, settings: LayerwiseSettings, engine: str, dp_rank: int, tp_rank: int, tp_size: int,
                 block_size: int, num_blocks: int) -> None:
        self.settings = settings
        self.engine, self.dp_rank, self.tp_rank, self.tp_size = engine, dp_rank, tp_rank, tp_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.agent_name = f"ss-{engine}-dp{dp_rank}-tp{tp_rank}"
        self.endpoint = f"tcp://{settings.side_channel_host}:{settings.side_channel_port + dp_rank * tp_size + tp_rank}"
        self._q: queue.Queue[tuple] = queue.Queue()
        self._lock = threading.Lock()  # what the forward thread reads: results
        self._sending_over: set[str] = set()  # finished producers' req ids whose transfer is over, to report
        self._recv_over: list[tuple[str, tuple[int, ...] | None]] = []  # (req id, failed block ids or None)
        self._producers: dict[str, _Producer] = {}  # key -> producer
        self._by_req: dict[str, str] = {}  # producer req id -> key
        self._consumers: dict[str, _Consumer] = {}  # key -> reservation
        self._early: dict[str, tuple[float, tuple]] = {}  # key -> (when, notice or release) before its reservation
        self._closed = threading.Event()
        self._step: list[ProducerPlan] = []  # this step's producers (forward thread)
        self._idle = False  # this step runs no forward (forward thread)
        self._news = threading.Event()  # a transfer ended: something to report
        self._cuda = False
        self.ucx = UcxLog.configure()  # before the agent: UCX reads its environment once
        # no progress thread (it spins a core): UCX progresses inside our calls, all made by one thread (the
        # mover's; the metadata server's thread only reads bytes made at registration)
        from nixl._api import nixl_agent, nixl_agent_config

        self.nixl = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.link = ControlLink(settings.control, "worker", dp_rank, tp_rank, engine, self._on_control)
        self._threads: list[threading.Thread] = []

    # == setup (vLLM's register_kv_caches) ========================================================================
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = LocalKV(self.nixl, self.agent_name, kv_caches, self.num_blocks)
        self.num_layers = self.kv.num_layers
        self._cuda = self.kv.cuda
        self.peers = Peers(self.nixl, self.kv, self.tp_rank, self._q.put, self._dropped, self._closed)
        self._threads = [self.kv.serve(self.endpoint, self._closed),
                         threading.Thread(target=self._run, name="splitserve-kv-mover", daemon=True)]
        self._threads[-1].start()
        log.info("layerwise KV connector: agent %s, %d layers x %d regions, %d blocks, metadata at %s",
                 self.agent_name, self.num_layers, self.kv.regions_per_layer, self.num_blocks, self.endpoint)

    # == the forward thread's calls ===============================================================================
    def begin_step(self, plan: LayerwiseStepPlan) -> None:
        self._step = plan.producers
        self._idle = plan.idle
        if plan.reservations or plan.producers:
            self._q.put(("step", plan))

    def layer_saved(self, layer_name: str) -> None:
        if not self._step:
            return
        event = None
        if self._cuda:  # the layer's KV is written once the work queued so far on this stream has run
            event = torch.cuda.Event()
            event.record()
        self._q.put(("layer", self._step, self.kv.layer_index[layer_name], event))

    def step_done(self) -> None:
        """The step's forward is queued (on a GPU, not necessarily run: the mover waits for an event recorded
        after it). Layers whose saves a CUDA graph skipped go here, all at once."""
        if self._step:
            event = None
            if self._cuda:
                event = torch.cuda.Event()
                event.record()
            self._q.put(("end", self._step, event))
            self._step = []

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[int]]:
        """(finished sending, finished receiving, block ids whose load failed) since the last call."""
        if finished_req_ids:  # after this step's own items: a request is known before its finish
            self._q.put(("finished", frozenset(finished_req_ids)))
        if self._idle and not finished_req_ids and (self._consumers or self._producers):
            # vLLM steps without a forward, back to back, while requests wait for their transfers (a core of
            # busy loop, and on a small host the other server's): wait a little for news instead
            self._news.wait(IDLE_WAIT_S)
        with self._lock:
            self._news.clear()
            sending, self._sending_over = self._sending_over, set()
            recv, self._recv_over = self._recv_over, []
        errors: set[int] = set()
        for _, failed in recv:
            errors.update(failed or ())
        return sending, {r for r, _ in recv}, errors

    # == the control line (the worker beside vLLM) ================================================================
    def _on_control(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "ticket":
            try:
                ticket = LayerwiseTicket.from_json(fields["ticket"])
            except WireError as e:
                log.warning("a ticket from the worker did not validate: %s", e)
                return
            self._q.put(("ticket", fields["key"], ticket))
        elif kind in ("drop", "release"):
            self._q.put((kind, fields["key"]))

    # == the mover thread ==========================================================================================
    def _run(self) -> None:
        idle = 0.0
        spin = SPIN_S or (2e-4 if self._cuda else 1e-3)
        while not self._closed.is_set():
            busy = any(p.inflight or (p.ticket and not p.over) for p in self._producers.values()) or self._consumers
            try:
                item = self._q.get(timeout=spin if busy else max(idle, 1e-3))
            except queue.Empty:
                item = None
            try:
                while item is not None:
                    self._handle(item)
                    item = self._q.get_nowait()
            except queue.Empty:
                pass
            got = self._poll()
            idle = 0.0 if busy or got or item is not None else min(IDLE_MAX_S, max(1e-3, 2 * idle))

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        log.debug("mover: %s %s", kind, str(item[1:])[:200])
        if kind == "step":
            plan: LayerwiseStepPlan = item[1]
            for r in plan.reservations:
                c = _Consumer(r.req_id, r.key, r.block_ids, r.deadline)
                self._consumers[r.key] = c
                early = self._early.pop(r.key, None)
                if early is not None:
                    self._on_notice(*early[1])
            for pp in plan.producers:
                p = self._producer(pp.key)
                if p.req_id is None:
                    p.req_id = pp.req_id
                    self._by_req[pp.req_id] = pp.key
                p.block_ids, p.num_prompt = pp.block_ids, pp.num_prompt
        elif kind == "layer":
            _, step, layer, event = item
            if event is not None:
                event.synchronize()
            for pp in step:
                p = self._producers.get(pp.key)
                if p is not None:
                    self._send(p, layer + 1, pp.end, pp.block_ids)
        elif kind == "end":
            if item[2] is not None:
                item[2].synchronize()
            for pp in item[1]:
                p = self._producers.get(pp.key)
                if p is not None:
                    p.computed = max(p.computed, pp.end)
                    self._send(p, self.num_layers, p.computed, pp.block_ids)
        elif kind == "ticket":
            _, key, ticket = item
            p = self._producer(key)
            if p.ticket is not None or p.over:
                return
            p.ticket = ticket
            if ticket.tp_size != self.tp_size:
                self._fail(p, f"prefill TP={self.tp_size} into decode TP={ticket.tp_size}: the layerwise "
                              "connector moves equal shards only")
                return
            p.sent = [ticket.first_block * ticket.block_size] * self.num_layers
            self.peers.want(key, ticket)
        elif kind == "peer":  # the loader fetched a decode rank's metadata (or failed to)
            _, key, name, endpoint, info, error = item
            p = self._producers.get(key)
            if p is None or p.over:
                return
            peer = self.peers.get(name) if not error else None
            if peer is None and not error:
                if info is None:  # known when the loader looked, dropped since
                    error = "its agent was dropped meanwhile"
                else:
                    peer, error = self.peers.load(name, endpoint, info)
            if peer is None:
                self._fail(p, f"decode rank {endpoint}: {error}")
            else:
                p.peer = peer
                self._send(p, self.num_layers, p.computed, p.block_ids)
        elif kind == "drop_peer":
            self.peers.drop(item[1], item[2])
        elif kind == "drop":
            p = self._producers.get(item[1])
            if p is not None and p.ticket is None:
                p.dropped = True
                self._over(p)
        elif kind == "release":
            self._on_notice("A", item[1], 0, "the ticket was never published")
        elif kind == "finished":
            for req_id in item[1]:
                key = self._by_req.get(req_id)
                p = self._producers.get(key) if key else None
                if p is not None:
                    p.finished, p.finished_at = True, time.monotonic()
                    self._report(p)

    def _producer(self, key: str) -> _Producer:
        p = self._producers.get(key)
        if p is None:
            p = self._producers[key] = _Producer(key)
        return p

    # -- prefill side: writes ------------------------------------------------------------------------------------
    def _send(self, p: _Producer, layers_done: int, end: int, block_ids: tuple[int, ...]) -> None:
        """Post what layers [0, layers_done) hold of tokens [sent, end) and the ticket wants: runs of consecutive
        layers with the same range go as one write, `layer_group` layers at a time while layers are still
        coming."""
        t, peer = p.ticket, p.peer
        if t is None or peer is None or p.failed or p.over:
            return
        if now() > t.deadline:  # no write is posted after it: the receiver counts on that
            self._fail(p, "the ticket's deadline passed")
            return
        end = min(end, t.num_tokens)
        group = self.settings.layer_group
        todo = [j for j in range(layers_done) if p.sent[j] < end]
        if not todo:
            self._maybe_done(p)
            return
        # while the forward goes on, wait for a whole group (the last layers of a step go as they are)
        if layers_done < self.num_layers and len(todo) < group:
            return
        start = 0
        while start < len(todo):
            stop = start + 1
            while stop < len(todo) and todo[stop] == todo[stop - 1] + 1 and p.sent[todo[stop]] == p.sent[todo[start]]:
                stop += 1
            layers = todo[start:stop]
            try:
                self._post(p, peer, t, layers, p.sent[layers[0]], end, block_ids)
            except ValueError as e:  # the request's blocks do not cover the ticket's
                self._fail(p, str(e))
                return
            except Exception as e:  # noqa: BLE001  NIXL's bindings raise their own types: the peer is unusable
                self._fail(p, f"write to {peer.info.agent}: {type(e).__name__}: {e}", drop_peer=True)
                return
            for j in layers:
                p.sent[j] = end
            start = stop
        self._maybe_done(p)

    def _post(self, p: _Producer, peer: Peer, t: LayerwiseTicket, layers: list[int], a: int, b: int,
              block_ids: tuple[int, ...]) -> None:
        bs = t.block_size
        a = max(a, t.first_block * bs)
        if a >= b:
            return
        blk0, blk1 = a // bs, (b - 1) // bs + 1
        src = np.asarray(block_ids[blk0:blk1], dtype=np.int64)
        dst = np.asarray(t.block_ids[blk0 - t.first_block:blk1 - t.first_block], dtype=np.int64)
        if len(src) != blk1 - blk0:
            raise ValueError(f"{p.key}: the request holds {len(block_ids)} blocks, {blk1} needed")
        per = self.kv.regions_per_layer
        rows = (np.asarray(layers, dtype=np.int64)[:, None] * per + np.arange(per)[None, :]).reshape(-1)
        local = (self.kv.offsets[rows][:, None] + src[None, :]).reshape(-1)
        remote = (peer.offsets[rows][:, None] + dst[None, :]).reshape(-1)
        nbytes = int(sum(self.kv.regions[r].block_bytes for r in rows)) * len(src)
        handle = self.nixl.make_prepped_xfer("WRITE", self.kv.prep, local.astype(np.int32), peer.prep,
                                             remote.astype(np.int32))
        if self.nixl.transfer(handle) == "ERR":
            self.nixl.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused the write")
        p.inflight.append((handle, nbytes))

    def _reap(self, p: _Producer) -> None:
        while p.inflight:
            handle, nbytes = p.inflight[0]
            try:
                state = self.nixl.check_xfer_state(handle)
            except Exception as e:  # noqa: BLE001  NIXL's own error types: the write is as good as failed
                log.debug("check_xfer_state: %s", e)
                state = "ERR"
            if state not in ("DONE", "ERR"):
                return
            p.inflight.popleft()
            with contextlib.suppress(Exception):  # a handle NIXL cannot free is NIXL's to keep
                self.nixl.release_xfer_handle(handle)
            if state == "ERR":
                self._fail(p, f"NIXL reported a failed write to {p.peer.info.agent if p.peer else '?'}",
                           drop_peer=True)
                return
            p.bytes_done += nbytes
            self._report_transport(p)

    def _maybe_done(self, p: _Producer) -> None:
        t = p.ticket
        if t is None or p.failed or p.over or p.inflight or p.peer is None:
            return
        if min(p.sent) >= t.num_tokens:
            try:
                self.nixl.send_notif(p.peer.info.agent, done_notice(t.key, p.bytes_done))
            except Exception as e:  # noqa: BLE001  (NIXL raises its own error types) the receiver times it out
                self._fail(p, f"the final notice to {p.peer.info.agent}: {e}", drop_peer=True)
                return
            self.link.send("sent", key=p.key, ok=True, bytes=p.bytes_done, reason="", rank=self.tp_rank)
            self._over(p)

    def _fail(self, p: _Producer, reason: str, drop_peer: bool = False) -> None:
        """No more writes; the abort notice goes once none is in flight (`_poll`), or now."""
        if p.failed or p.over:
            return
        p.failed = reason
        log.warning("layerwise KV transfer %s stopped: %s", p.key, reason)
        if drop_peer and p.peer is not None:
            self.peers.drop(p.peer.info.agent, reason)
        self._finish_failed(p)

    def _finish_failed(self, p: _Producer) -> None:
        if p.inflight and now() < (p.ticket.deadline if p.ticket else 0) + GRACE_S:
            return  # still in flight: the notice must not overtake them
        for handle, _ in p.inflight:
            try:
                self.nixl.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001  a write NIXL cannot cancel: its deadline has passed anyway
                pass
        p.inflight.clear()
        # a ticket this rank holds no request for (another data-parallel engine's, or one that never ran here)
        # sends no notice: the rank that ran it speaks for it, or the receiver's deadline does
        if p.req_id is not None and p.ticket is not None and p.peer is not None and \
                self.peers.known(p.peer.info.agent):
            try:
                self.nixl.send_notif(p.peer.info.agent, abort_notice(p.ticket.key, p.failed))
            except Exception:  # noqa: BLE001  the receiver's deadline covers a notice that cannot go
                pass
        if p.ticket is not None and p.req_id is not None:
            self.link.send("sent", key=p.key, ok=False, bytes=p.bytes_done, reason=p.failed[:300], rank=self.tp_rank)
        self._over(p)

    def _over(self, p: _Producer) -> None:
        p.over = True
        self._report(p)

    def _report(self, p: _Producer) -> None:
        """A producer vLLM finished whose transfer is over: its blocks may go (reported once)."""
        if p.over and p.finished and p.req_id is not None and not p.reported:
            p.reported = True
            with self._lock:
                self._sending_over.add(p.req_id)
            self._news.set()

    def _report_transport(self, p: _Producer) -> None:
        peer = p.peer
        if peer is None or peer.reported:
            return
        peer.reported = True
        new = [t for t in self.ucx.read() if self.agent_name.startswith(t.worker) and t.scope != "self"]
        table = new[-1] if new else self.ucx.transport_for(self.agent_name)
        if table is None:
            peer.reported = False  # not logged yet: asked again at the next write that completes
            return
        self.link.send("transport", peer=peer.info.agent, host=peer.endpoint.removeprefix("tcp://"),
                       transport=table.transport,
                       local_mem=self.kv.mem_type, remote_mem=peer.info.mem_type, rank=self.tp_rank)

    # -- decode side: notices --------------------------------------------------------------------------------------
    def _on_notice(self, kind: str, key: str, nbytes: int, reason: str) -> None:
        c = self._consumers.pop(key, None)
        if c is None:
            self._early[key] = (time.monotonic(), (kind, key, nbytes, reason))
            return
        ok = kind == "D"
        if not ok:
            log.warning("layerwise KV for %s did not land (%s): vLLM recomputes it", key, reason)
        with self._lock:
            self._recv_over.append((c.req_id, None if ok else c.block_ids))
        self._news.set()
        self.link.send("landed", key=key, ok=ok, bytes=nbytes, reason=reason[:300], rank=self.tp_rank)

    def _poll(self) -> bool:
        """Progress writes and notices, apply deadlines; whether anything happened."""
        got = False
        try:
            notifs = self.nixl.get_new_notifs()
        except Exception as e:  # noqa: BLE001  the agent is shutting down
            log.debug("nixl notif poll: %s", e)
            return False
        for msgs in notifs.values():
            for msg in msgs:
                parsed = parse_notice(msg)
                if parsed is not None:
                    got = True
                    self._on_notice(*parsed)
        t = now()
        for p in list(self._producers.values()):
            if p.inflight:
                self._reap(p)
                self._maybe_done(p)
            if p.failed and not p.over:
                self._finish_failed(p)
            elif p.ticket is not None and not p.over and t > p.ticket.deadline:
                self._fail(p, "the ticket's deadline passed")
            elif p.ticket is None and not p.over and p.finished and \
                    time.monotonic() - p.finished_at > self.settings.ticket_wait_seconds:
                self._over(p)  # no ticket came: nothing was sent
            if p.over and (p.reported or p.req_id is None) and not p.inflight:
                if p.req_id is None and time.monotonic() - p.created < EARLY_KEEP_S:
                    continue  # a ticket before its request: keep it for the request
                self._producers.pop(p.key, None)
                if p.req_id is not None:
                    self._by_req.pop(p.req_id, None)
        for c in list(self._consumers.values()):
            if t > c.deadline + GRACE_S:
                self._on_notice("A", c.key, 0, "the ticket's deadline passed")
        if self._early:
            cutoff = time.monotonic() - EARLY_KEEP_S
            for key in [k for k, (when, _) in self._early.items() if when < cutoff]:
                self._early.pop(key, None)
        return got

    def _dropped(self, name: str, endpoint: str) -> None:
        self.link.send("dropped", peer=name, host=endpoint.removeprefix("tcp://"), rank=self.tp_rank)

    def shutdown(self) -> None:
        self._closed.set()
        self.peers.close()
        for t in self._threads:
            t.join(timeout=2.0)
        self.link.close()
