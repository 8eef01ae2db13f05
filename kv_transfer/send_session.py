"""One request's stream from one rank (`SendSession`), on the sender's side of a `KVTransferAgent`: layers queued
as they are written, written on the agent's sender thread, in order, through one channel per route."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from splitserve.kv_transfer import metrics
from splitserve.kv_transfer.errors import TransferCancelled, TransferError, TransferTimeout
from splitserve.kv_transfer.layout import coalesce
from splitserve.kv_transfer.shards import Route
from splitserve.kv_transfer.ticket import TransferTicket

if TYPE_CHECKING:
    from splitserve.kv_transfer.agent import Channel, KVTransferAgent


class SendSession:
    """One request's stream from one rank: `send_layer` queues layer i's blocks of every route this rank sends
    (none, for a rank whose heads another rank sends); `finish` waits for all of it."""

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
        metrics.IN_FLIGHT.labels("send", agent.backend.name).inc()

    def send_layer(self, layer: int, indices: range | None = None, final: bool = True,
                   event: torch.cuda.Event | None = None) -> None:
        """Queue layer `layer`'s blocks at prompt positions `indices` (default: all). Returns at once.

        `event`, on CUDA, is recorded after the layer's KV was written; the sender waits on it first.
        """
        if indices is None:
            indices = range(len(self.ticket.block_ids))
        skip = self.ticket.skip_blocks
        pairs = [(self.src_block_ids[i], self.ticket.block_ids[i]) for i in indices if i >= skip]
        runs = coalesce([s for s, _ in pairs], [d for _, d in pairs])
        self._enqueue(lambda: self._write(layer, runs, final, event))

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
        self.send_layer(-1, indices, True, event)

    def _write(self, layer: int, runs, final: bool, event) -> None:
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
            n += channel.write_all(runs) if layer < 0 else channel.write_layer(layer, runs, final)
        self.bytes += n
        metrics.BYTES.labels("send", self.agent.backend.name).inc(n)

    def _flush(self) -> None:
        for channel in self._channels or ():
            channel.flush()

    def finish(self, timeout: float | None = None) -> None:
        """Wait until every queued layer was written; raises the first error."""
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
