"""Bounds on what a long-lived CPU worker's memory grows by under an endless mix of shapes.

Continuous batching gives the model a new shape at almost every step (batch sizes, chunk lengths, prompt
lengths). Two caches grew with them, so a CPU worker's RSS kept rising for as long as it served (+14% over ten
minutes of `benchmarks/soak.py`):
- oneDNN keeps one compiled primitive per shape it has seen (1024 by default). 32 hold the shapes a step
  repeats; 8 halved throughput (the same primitives were built again at every step).
- glibc raises its mmap threshold each time a large block is freed, up to 32 MiB, after which large temporary
  tensors come from the heap and leave it fragmented. A fixed threshold keeps them on mmap, handed back to the
  kernel when freed.
An operator's own settings (ONEDNN_PRIMITIVE_CACHE_CAPACITY, MALLOC_MMAP_THRESHOLD_) win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

ONEDNN_CACHE_VAR = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = 32
MMAP_THRESHOLD_VAR = "MALLOC_MMAP_THRESHOLD_"
MMAP_THRESHOLD_BYTES = 256 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def bound_host_memory() -> None:
    """Call before the model's first step (oneDNN reads its capacity once, on first use)."""
    os.environ.setdefault(ONEDNN_CACHE_VAR, str(ONEDNN_CACHE_CAPACITY))
    if MMAP_THRESHOLD_VAR in os.environ:
        return
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        libc = None
    mallopt = getattr(libc, "mallopt", None)  # glibc only: musl and others have no tunable threshold
    if mallopt is None or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.info("malloc's mmap threshold left as it is (no glibc mallopt)")
