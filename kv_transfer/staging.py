"""The NIXL sender's staging ring: head slabs (a route carrying only some of the sender's KV heads) are copied
per layer into a registered buffer and written from it in whole blocks, so NIXL descriptors merge instead of
one per token."""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

# bytes of the sender's staging ring for head slabs (registered on the KV's device at the first staged route)
STAGING_BYTES = int(os.environ.get("SPLITSERVE_KV_STAGING_MB", "0")) << 20 or None
STAGING_DEFAULT = {"cuda": 256 << 20, "cpu": 32 << 20}


@dataclass
class _Slot:
    start: int  # byte offset in the ring
    end: int
    freed: bool = False


class StagingRing:
    """A registered buffer handed out in FIFO order: a staged write takes a slot before its copy and frees it once
    NIXL reports the write done (writes finish roughly in order, so the oldest slots come back first)."""

    def __init__(self, nixl, layout, size: int) -> None:
        self.nixl = nixl
        self.buf = torch.empty(size, dtype=torch.uint8, device=layout.device)
        self.reg = nixl.register_memory(nixl.get_reg_descs([self.buf]))
        # a high-priority stream: the copies are small, and the prefill's big kernels on the same GPU would
        # otherwise keep them (and every write waiting on them) queued behind whole waves of blocks
        self.stream = torch.cuda.Stream(layout.device, priority=-1) if layout.is_cuda else None
        self.size = size
        self._slots: deque[_Slot] = deque()
        self._lock = threading.Lock()
        self._preps: dict[int, object] = {}  # entry bytes -> prepped dlist of the ring in entries of that size

    def prep(self, entry: int, mem_type: str, dev: int):
        """The ring as `size // entry` dense entries of `entry` bytes (index i: bytes [i * entry, ...))."""
        with self._lock:
            if entry not in self._preps:
                rows = np.array([(self.buf.data_ptr(), entry, dev, entry, self.size // entry)], dtype=np.int64)
                self._preps[entry] = self.nixl.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type)
            return self._preps[entry]

    def take(self, nbytes: int, align: int) -> _Slot | None:
        """A slot of `nbytes` starting at a multiple of `align`, or None while the ring is full."""
        with self._lock:
            while self._slots and self._slots[0].freed:
                self._slots.popleft()
            start, limit = 0, self.size
            if self._slots:
                oldest, newest = self._slots[0], self._slots[-1]
                head = -(-newest.end // align) * align
                if newest.start >= oldest.start:  # not wrapped: after the newest, else from 0 up to the oldest
                    start, limit = (head, self.size) if head + nbytes <= self.size else (0, oldest.start)
                else:  # wrapped: between the newest and the oldest
                    start, limit = head, oldest.start
            if start + nbytes > limit:
                return None
            slot = _Slot(start, start + nbytes)
            self._slots.append(slot)
            return slot

    def give(self, slot: _Slot | None) -> None:
        if slot is not None:
            with self._lock:
                slot.freed = True

    def close(self) -> None:
        for prep in self._preps.values():
            try:
                prep.release()
            except Exception:
                pass
        try:
            self.nixl.deregister_memory(self.reg)
        except Exception:
            pass
