"""The engine's layer hook on a prefill worker: streams each registered request's blocks layer by layer.

For every step, the blocks a request's chunk touched (plus, on its first chunk, blocks it found in its own
prefix cache) are sent as soon as the engine reports that layer written. The final chunk's writes carry the
`final` flag, so the receiver knows when each layer is complete.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from splitserve.kv_transfer.agent import SendSession


@dataclass
class _Stream:
    session: SendSession
    num_prompt_tokens: int
    next_block: int = 0  # first prompt block not yet sent complete
    queued_final: threading.Event = field(default_factory=threading.Event)


class KVStreamHook:
    def __init__(self, block_size: int, cuda: bool = False) -> None:
        self.block_size = block_size
        self.cuda = cuda
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._step: list[tuple[_Stream, range, bool]] = []

    def register(self, request_id: str, session: SendSession, num_prompt_tokens: int) -> threading.Event:
        """Stream `request_id`'s prompt KV through `session`; the event fires once every layer is queued."""
        stream = _Stream(session, num_prompt_tokens)
        with self._lock:
            self._streams[request_id] = stream
        return stream.queued_final

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    # -- KVLayerHook ---------------------------------------------------------------------------------
    def on_step_begin(self, scheduled) -> None:
        self._step = []
        with self._lock:
            if not self._streams:
                return
            for s in scheduled:
                stream = self._streams.get(s.request_id)
                if stream is None or s.start >= stream.num_prompt_tokens:
                    continue
                end = min(s.start + s.num_new_tokens, stream.num_prompt_tokens)
                last_block = -(-end // self.block_size)
                final = end == stream.num_prompt_tokens
                self._step.append((stream, range(stream.next_block, last_block), final))
                stream.next_block = end // self.block_size

    def on_layer_written(self, layer_idx: int) -> None:
        if not self._step:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        for stream, indices, final in self._step:
            stream.session.send_layer(layer_idx, indices, final, event)

    def on_step_end(self, scheduled) -> None:
        for stream, _, final in self._step:
            if final:
                stream.queued_final.set()
        self._step = []
