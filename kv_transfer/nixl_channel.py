"""One request's NIXL writes along one route (`NixlChannel`), on the sender's side of `nixl_backend`.

Descriptors: NIXL merges entries contiguous on both sides into one descriptor. A run of blocks can be cut into
descriptors of `nixl_backend.CHUNK_BYTES` (K and V alternating, so the merging stops at each cut); between two
H200s cutting measured slower, so runs are not cut by default.

Notifications: a notified NIXL write flushes the endpoint before its notice goes, so a notice per layer
serialized the layers (82 GB/s layer-wise against 200 GB/s whole between two H200s). Writes carry none; the
channel tracks their completion and sends the request's notice itself (`NixlChannel._notify`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitserve.kv_transfer.errors import TransferError, TransferTimeout
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.shards import Route
from splitserve.kv_transfer.staging import StagingRing, _Slot
from splitserve.kv_transfer.ticket import TransferTicket

if TYPE_CHECKING:
    from splitserve.kv_transfer.nixl_backend import NixlBackend

# seconds between polls while a transfer is expected (receiver) or a write is in flight (sender)
SPIN_S = float(os.environ.get("SPLITSERVE_KV_POLL_US", "50")) * 1e-6
# seconds between a channel's progress notices; 0: none, only the request's notice. A request landing within
# this long sends one notice per route.
PROGRESS_S = float(os.environ.get("SPLITSERVE_KV_PROGRESS_MS", "5")) * 1e-3


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


class NixlChannel:
    """Posts each layer's writes (several layers' in one, `write_layers`; every layer's, `write_all`) at once,
    without a notification and without waiting; one notice per request and route follows once every layer's final
    write was posted and every write of the request completed locally, so the notice never overtakes data
    (`_notify`). While writes are slow to land (a paced prefill), a progress notice per landed layer goes at most
    every PROGRESS_S, never on a write.

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

    def write_layers(self, layers: range, runs: list[tuple[int, int, int]], final: bool) -> int:
        """Consecutive layers' writes in one NIXL transfer (a transfer has a fixed cost, whatever its size)."""
        if self.ring is not None:  # the ring holds a few layers, not a whole prompt: layer by layer
            return sum(self.write_layer(layer, runs, final) for layer in layers)
        n = self._post(list(layers), runs)
        if final:
            self._mark_final(layers)
        return n

    def write_all(self, runs: list[tuple[int, int, int]]) -> int:
        return self.write_layers(range(self.layout.num_layers), runs, True)

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
        """The abort notice, once this channel's writes in flight completed (or its deadline passed): the
        receiver reads it as "no write of this sender can land any more" and may free the blocks."""
        with contextlib.suppress(TransferError):  # failed or late writes: they are over either way
            self._wait()
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
