"""Process helpers shared by the launcher, the tensor-parallel ranks and the tests: free ports and children
that die with their parent."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn for children: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
