"""One request's stream from one rank (`SendSession`), on the sender's side of a `KVTransferAgent`: layers queued
as they are written, written on the agent's sender thread, in order, through one channel per route."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.kv_transfer import metrics
from splitserve.kv_transfer.errors import TransferCancelled, TransferError, TransferTimeout
from splitserve.kv_transfer.layout import coalesce
from splitserve.kv_transfer.shards import Route
from splitserve.kv_transfer.ticket import TransferTicket

if TYPE_CHECKING:
    from splitserve.kv_transfer.agent import Channel, KVTransferAgent


def _layer_group(raw: str) -> int:
    try:
        group = int(raw)
    except ValueError:
        group = 0
    if group < 1:
        raise ValueError(f"SPLITSERVE_NIXL_LAYER_GROUP must be an integer >= 1, got {raw!r}")
    return group


# Measurement knob: consecutive layers of one step sent as one write (one NIXL transfer, which has a fixed cost
# each) once this many are written; 1: a write per layer. Read by each session when it starts.
LAYER_GROUP = _layer_group(os.environ.get("SPLITSERVE_NIXL_LAYER_GROUP", "1"))


@dataclass
class _Group:
    """Consecutive layers of one step, same blocks and final flag, buffered to go as one write."""

    layers: range
    indices: range  # prompt block positions
    final: bool
    runs: list[tuple[int, int, int]]  # (src_block, dst_block, n): the step's blocks, the same for every layer
    event: torch.cuda.Event | None  # the last layer's: recorded in stream order, it covers the earlier ones


class SendSession:
    """One request's stream from one rank: `send_layer` queues layer i's blocks of every route this rank sends
    (none, for a rank whose heads another rank sends); `finish` waits for all of it. With a `LAYER_GROUP` of g,
    layers are held until g consecutive ones of a step are written (or the model's last layer, or a call that
    does not continue them), then go as one write."""

    def __init__(self, agent: KVTransferAgent, ticket: TransferTicket, src_block_ids: list[int],
                 routes: list[Route]) -> None:
        self.agent = agent
        self.ticket = ticket
        self.src_block_ids = src_block_ids
        self.routes = routes
        self.error: TransferError | None = None
        self.bytes = 0
        self._channels: list[Channel] | None = None  # one per route, opened at the first write
        self._queued = 0
        self._done_jobs = 0
        self._cv = threading.Condition()
        self._started = time.monotonic()
        self._closed = False
        self._layer_group = LAYER_GROUP
        self._group: _Group | None = None  # layers written, not yet queued
        # guards `_group`: a stream hook may replay layers written before the ticket came while the engine's
        # thread sends the next ones
        self._group_lock = threading.Lock()
        metrics.IN_FLIGHT.labels("send", agent.backend.name).inc()

    def send_layer(self, layer: int, indices: range | None = None, final: bool = True,
                   event: torch.cuda.Event | None = None) -> None:
        """Queue layer `layer`'s blocks at prompt positions `indices` (default: all). Returns at once.

        `event`, on CUDA, is recorded after the layer's KV was written; the sender waits on it first.
        """
        if indices is None:
            indices = range(len(self.ticket.block_ids))
        with self._group_lock:
            group = self._group
            if group is not None and (layer != group.layers.stop or indices != group.indices
                                      or final != group.final):
                self._send_group()
                group = None
            if group is None:
                group = self._group = _Group(range(layer, layer + 1), indices, final, self._runs(indices), event)
            else:
                group.layers = range(group.layers.start, layer + 1)
                group.event = event
            if len(group.layers) >= self._layer_group or layer == self.agent.layout.num_layers - 1:
                self._send_group()

    def _runs(self, indices: range) -> list[tuple[int, int, int]]:
        """(src_block, dst_block, n) runs of the blocks at prompt positions `indices`, less the skipped prefix."""
        skip = self.ticket.skip_blocks
        pairs = [(self.src_block_ids[i], self.ticket.block_ids[i]) for i in indices if i >= skip]
        return coalesce([s for s, _ in pairs], [d for _, d in pairs])

    def _send_group(self) -> None:
        """Queue the buffered layers as one write (the caller holds `_group_lock`: queued in the order buffered)."""
        group, self._group = self._group, None
        if group is not None:
            self._enqueue(lambda: self._write(group.layers, group.runs, group.final, group.event))

    def _enqueue(self, fn) -> None:
        """Run `fn` on the agent's sender thread; `finish` waits for every enqueued job."""
        with self._cv:
            self._queued += 1

        def job() -> None:
            try:
                self._guarded(fn)
            finally:
                with self._cv:
                    self._done_jobs += 1
                    self._cv.notify_all()

        self.agent._jobs.put(job)

    def _guarded(self, fn) -> None:
        """Call `fn` unless the session already failed or closed; any failure becomes its typed error."""
        if self.error is not None or self._closed:
            return
        try:
            fn()
        except TransferError as e:
            self.error = e
        except Exception as e:  # backend failures become typed errors
            self.error = TransferError(f"{self.ticket.request_id}: send failed: {e}")

    def _poll(self) -> bool:
        """Progress this session's in-flight writes; True while some remain."""
        busy = False

        def poll() -> None:
            nonlocal busy
            busy = any([bool(c.poll()) for c in self._channels])  # a list: poll every one

        if self._channels:
            self._guarded(poll)
        return busy

    def send_all(self, indices: range | None = None, event: torch.cuda.Event | None = None) -> None:
        """Queue every layer at once as one transfer (whole-request mode, when the KV is already computed)."""
        runs = self._runs(range(len(self.ticket.block_ids)) if indices is None else indices)
        with self._group_lock:
            self._send_group()
            self._enqueue(lambda: self._write(None, runs, True, event))

    def _write(self, layers: range | None, runs, final: bool, event) -> None:
        """Write `layers` (None: every layer) of `runs` on every route's channel."""
        if not self.routes:
            return
        if event is not None:
            event.synchronize()
        if self._channels is None:
            self._channels = [self.agent.backend.open_channel(self.ticket, r) for r in self.routes]
            self.agent._active.add(self)
        if time.time() > self.ticket.deadline:
            raise TransferTimeout(f"{self.ticket.request_id}: deadline passed while sending")
        n = 0
        for channel in self._channels:
            if layers is None:
                n += channel.write_all(runs)
            elif len(layers) == 1:
                n += channel.write_layer(layers.start, runs, final)
            else:
                n += channel.write_layers(layers, runs, final)
        self.bytes += n
        metrics.BYTES.labels("send", self.agent.backend.name).inc(n)

    def _flush(self) -> None:
        for channel in self._channels or ():
            channel.flush()

    def finish(self, timeout: float | None = None) -> None:
        """Wait until every queued layer was written (buffered ones are queued first); raises the first error."""
        with self._group_lock:
            self._send_group()
        self._enqueue(self._flush)
        if timeout is None:
            timeout = max(0.0, self.ticket.deadline - time.time()) + 1.0
        with self._cv:
            ok = self._cv.wait_for(lambda: self._done_jobs == self._queued, timeout)
        if not ok and self.error is None:
            self.error = TransferTimeout(f"{self.ticket.request_id}: sending did not finish in time")
        self._close(self.error)
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop sending: writes still queued are dropped (the session failed), and on the sender thread, the only
        one that posts writes, each channel waits out its writes in flight, then tells the receiver (where the
        backend can): it fails fast, and knows no write of this sender can land any more. Returns at once."""
        self.error = self.error or TransferCancelled(f"{self.ticket.request_id}: sender aborted")
        with self._group_lock:
            self._group = None
        if self.agent._closed:  # no sender thread any more: nothing is in flight
            self._abort_channels()
        else:
            self.agent._jobs.put(self._abort_channels)

    def _abort_channels(self) -> None:
        for channel in self._channels or ():
            try:
                channel.abort()
            except Exception:  # a channel whose peer is gone cannot be told: its deadline ends the transfer
                pass
        self._close(self.error)

    def _close(self, error: TransferError | None) -> None:
        if self._closed:
            return
        self._closed = True
        metrics.record_end("send", self.agent.backend.name, error, time.monotonic() - self._started)
        self.agent._active.discard(self)
        for channel in self._channels or ():
            channel.close()
