"""The engine's layer hook on a prefill worker: streams each registered request's blocks layer by layer.

For every step, the blocks a request's chunk touched (plus, on its first chunk, blocks it found in its own
prefix cache) are sent as soon as the engine reports that layer written. The final chunk's writes carry the
`final` flag, so the receiver knows when each layer is complete.

Under tensor parallelism this hook runs on rank 0 and is also the planner for the other ranks: `rank_plan`
lists, for the step, each stream's blocks to send (`sharded.PlanEntry`), and the step carries it to every
follower's connector, which sends that rank's heads of the same blocks as its layers are written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve.common.latch import Latch
from splitserve.engine.kv_cache_manager import cdiv
from splitserve.kv_transfer.agent import SendSession
from splitserve.kv_transfer.errors import TransferError
from splitserve.kv_transfer.sharded import PlanEntry

log = logging.getLogger("splitserve.kv_transfer.hook")


@dataclass
class _Stream:
    num_prompt_tokens: int
    session: SendSession | None = None
    # builds the session from our block ids; None while the ticket it needs has not come (see `attach`)
    factory: Callable[[list[int]], SendSession | None] | None = None
    src_block_ids: list[int] | None = None  # ours, as of the last step that scheduled the request
    deferred: list[tuple[int, range, bool, torch.cuda.Event | None]] = field(default_factory=list)
    next_block: int = 0  # first prompt block not yet sent complete
    queued_final: Latch = field(default_factory=Latch)
    error: TransferError | None = None


class KVStreamHook:
    def __init__(self, block_size: int, cuda: bool = False) -> None:
        self.block_size = block_size
        self.cuda = cuda
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._step: list[tuple[_Stream, range, bool]] = []

    def register(self, request_id: str, session: SendSession | Callable[[list[int]], SendSession],
                 num_prompt_tokens: int) -> Latch:
        """Stream `request_id`'s prompt KV; the event fires once every layer is queued (or the stream failed).

        `session` is a SendSession, or a factory called on the engine thread with the request's block ids at
        its first scheduled step (a prefill worker learns its block ids only then). The factory returns None
        while the decode side's ticket has not come: the layers written meanwhile are kept, and sent by `attach`
        (the ticket came) or at the next step that finds the factory ready.
        """
        if isinstance(session, SendSession):
            stream = _Stream(num_prompt_tokens, session=session)
        else:
            stream = _Stream(num_prompt_tokens, factory=session)
        with self._lock:
            self._streams[request_id] = stream
        return stream.queued_final

    def session(self, request_id: str) -> SendSession | None:
        with self._lock:
            stream = self._streams.get(request_id)
            return stream.session if stream else None

    def error(self, request_id: str) -> TransferError | None:
        with self._lock:
            stream = self._streams.get(request_id)
            return stream.error if stream else None

    def attach(self, request_id: str) -> None:
        """`request_id`'s ticket came (its factory now builds the session): if the request was already
        scheduled, start its session here and send the layers written so far."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and stream.session is None and stream.error is None and \
                    stream.src_block_ids is not None:
                self._start(stream)

    def _start(self, stream: _Stream) -> None:
        """Build the session (under the lock) and queue the layers written before it: a failed stream on error."""
        try:
            stream.session = stream.factory(stream.src_block_ids)
        except Exception as e:  # a bad ticket: fail this stream, keep the engine going
            self._fail(stream, e if isinstance(e, TransferError) else TransferError(str(e)))
            return
        if stream.session is not None:
            for layer, indices, final, event in stream.deferred:
                stream.session.send_layer(layer, indices, final, event)
            stream.deferred = []

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    # -- KVLayerHook ---------------------------------------------------------------------------------
    def on_step_begin(self, scheduled) -> bool:
        """Plan this step's sends; True when some registered request has blocks to stream in it."""
        self._step = []
        with self._lock:
            if not self._streams:
                return False
            for s in scheduled:
                stream = self._streams.get(s.request_id)
                if stream is None or stream.error is not None or s.start >= stream.num_prompt_tokens:
                    continue
                if s.start == 0 and stream.next_block > 0:  # preempted and recomputed: blocks changed
                    self._fail(stream, TransferError(f"{s.request_id}: preempted while streaming its KV"))
                    continue
                stream.src_block_ids = list(s.block_ids)
                if stream.session is not None:
                    stream.session.src_block_ids = stream.src_block_ids
                else:
                    self._start(stream)
                    if stream.error is not None:
                        continue
                end = min(s.start + s.num_new_tokens, stream.num_prompt_tokens)
                last_block = cdiv(end, self.block_size)
                final = end == stream.num_prompt_tokens
                self._step.append((stream, range(stream.next_block, last_block), final))
                stream.next_block = end // self.block_size
        return bool(self._step)

    @staticmethod
    def _fail(stream: _Stream, error: TransferError) -> None:
        log.warning("kv stream failed: %s", error)
        stream.error = error
        if stream.session is not None:
            stream.session.abort()
        stream.queued_final.set()

    def rank_plan(self) -> list[int]:
        """This step's sends for the follower ranks (streams whose session spans the ranks)."""
        plan: list[int] = []
        for stream, indices, final in self._step:
            sid = getattr(stream.session, "plan_id", None)
            if sid is not None:
                src = list(stream.session.src_block_ids[: indices.stop])
                plan += PlanEntry(sid, indices.start, indices.stop, final, src).encode()
        return plan

    def on_layer_written(self, layer_idx: int) -> None:
        if not self._step:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        for stream, indices, final in self._step:
            if stream.session is None:  # its ticket may be coming: `attach` takes the lock to send these
                with self._lock:
                    if stream.session is None:
                        stream.deferred.append((layer_idx, indices, final, event))
                        continue
            stream.session.send_layer(layer_idx, indices, final, event)

    def on_step_end(self, scheduled) -> None:
        for stream, _, final in self._step:
            if final:
                stream.queued_final.set()
        self._step = []
