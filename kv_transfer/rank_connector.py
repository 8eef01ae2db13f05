"""The KV connector of a follower rank (ranks 1..N-1 of a tensor-parallel worker): its own transfer agent over
its own KV shard, run by rank 0 over the rank's link (`sharded.py` defines the messages).

Receiving (decode), it accepts the writes rank 0 tells it to expect and reports each outcome. Sending
(prefill), it keeps the tickets rank 0 hands it and, in each step whose `rank_plan` names them, sends its
routes of every layer as the layer is written, then reports when its writes are done. The engine builds it on
each follower from `parallel.rank_connector = "splitserve.kv_transfer.rank_connector:follower_connector"`.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from splitserve.engine.parallel_link import LinkClosed
from splitserve.engine.parallel_worker import RankContext
from splitserve.kv_transfer.agent import KVTransferAgent, SendSession, make_agent
from splitserve.kv_transfer.errors import TransferError
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.sharded import (
    OP_ABORT,
    OP_CANCEL,
    OP_EXPECT,
    OP_LANDED,
    OP_QUIET,
    OP_SENT,
    OP_START,
    OP_STREAM,
    decode_plan,
)
from splitserve.kv_transfer.ticket import TransferTicket

log = logging.getLogger("splitserve.kv_transfer.rank")

SPEC = "splitserve.kv_transfer.rank_connector:follower_connector"


@dataclass
class _Stream:
    ticket: TransferTicket
    session: SendSession | None = None
    error: TransferError | None = None


class FollowerConnector:
    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.link = ctx.link
        self.layout = KVLayout(ctx.kv_caches, ctx.shard)
        self.agent: KVTransferAgent | None = None
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._step: list[tuple[_Stream, range, bool, int]] = []  # (stream, prompt blocks, final, sid)
        self._finishing: queue.Queue = queue.Queue()  # (sid, stream) whose writes are all queued
        self._finisher = threading.Thread(target=self._finish_loop, name="kv-rank-finish", daemon=True)
        self._finisher.start()
        for op, fn in ((OP_START, self._start), (OP_EXPECT, self._expect), (OP_CANCEL, self._cancel),
                       (OP_STREAM, self._stream), (OP_ABORT, self._abort)):
            self.link.handle(op, fn)

    # -- messages from rank 0 (on the link's thread) ----------------------------------------------------
    def _start(self, msg: dict) -> dict:
        if self.agent is None:
            self.agent = make_agent(msg["backend"], self.layout, msg.get("host", "127.0.0.1"))
            self.agent.on_finish = self._landed
        return {"endpoint": self.agent.endpoint().to_json()}

    def _need_agent(self) -> KVTransferAgent:
        if self.agent is None:
            raise RuntimeError("no transfer agent on this rank (kv.start first)")
        return self.agent

    def _expect(self, msg: dict) -> None:
        self._need_agent().expect_local(msg["rid"], msg["block_ids"], int(msg["skip_blocks"]), float(msg["deadline"]))

    def _cancel(self, msg: dict) -> None:
        agent = self._need_agent()
        rid = msg["rid"]
        agent.cancel(rid)
        agent.forget(rid)
        # rank 0 frees the blocks once every rank said no write can land any more (off the link's thread)
        threading.Thread(target=self._report_quiet, args=(agent, rid), name="kv-rank-quiet", daemon=True).start()

    def _report_quiet(self, agent: KVTransferAgent, rid: str) -> None:
        agent.quiet_blocking(rid)
        try:
            self.link.send({"op": OP_QUIET, "rid": rid})
        except LinkClosed:
            pass

    def _landed(self, request_id: str, error: TransferError | None) -> None:
        self.agent.forget(request_id)
        try:
            self.link.send({"op": OP_LANDED, "rid": request_id, "error": str(error) if error else None})
        except LinkClosed:
            pass

    def _stream(self, msg: dict) -> None:
        self._need_agent()
        ticket = TransferTicket.decode(msg["ticket"].encode())
        ticket.check_compatible(self.layout)
        with self._lock:
            self._streams[int(msg["sid"])] = _Stream(ticket)

    def _abort(self, msg: dict) -> None:
        with self._lock:
            stream = self._streams.pop(int(msg["sid"]), None)
        if stream is not None and stream.session is not None:
            stream.session.abort()

    # -- RankConnector: the steps (on the rank's main thread) ---------------------------------------------
    def on_step_begin(self, plan: list[int]) -> bool:
        self._step = []
        for entry in decode_plan(plan):
            with self._lock:
                stream = self._streams.get(entry.sid)
            if stream is None:  # aborted meanwhile
                continue
            if stream.error is None:
                try:
                    if stream.session is None:
                        stream.session = self.agent.begin(stream.ticket, entry.src_block_ids)
                    else:
                        stream.session.src_block_ids = entry.src_block_ids
                except Exception as e:  # reported when the stream ends
                    stream.error = e if isinstance(e, TransferError) else TransferError(str(e))
            self._step.append((stream, range(entry.start, entry.stop), entry.final, entry.sid))
        return any(s.session is not None and s.error is None for s, *_ in self._step)

    def on_layer_written(self, layer_idx: int) -> None:
        event = None
        if self.layout.is_cuda:
            event = torch.cuda.Event()
            event.record()
        for stream, indices, final, _ in self._step:
            if stream.session is not None and stream.error is None:
                stream.session.send_layer(layer_idx, indices, final, event)

    def on_step_end(self) -> None:
        for stream, _, final, sid in self._step:
            if final:
                with self._lock:
                    self._streams.pop(sid, None)
                self._finishing.put((sid, stream))
        self._step = []

    def _finish_loop(self) -> None:
        while (item := self._finishing.get()) is not None:
            sid, stream = item
            error = stream.error
            if error is None and stream.session is not None:
                try:
                    stream.session.finish()
                except TransferError as e:
                    error = e
            try:
                self.link.send({"op": OP_SENT, "sid": sid, "bytes": stream.session.bytes if stream.session else 0,
                                "error": str(error) if error else None})
            except LinkClosed:
                return

    def close(self) -> None:
        self._finishing.put(None)
        if self.agent is not None:
            self.agent.close()


def follower_connector(ctx: RankContext) -> FollowerConnector:
    return FollowerConnector(ctx)
