"""A message channel between rank 0 and one follower rank, beside the step broadcast: length-prefixed JSON over a
local socket pair made when rank 0 starts the follower.

The step broadcast is synchronous with the forward pass; this is for what is not: a rank's KV connector
starting its transfer agent, being told to expect or stream a request, and reporting (from its own threads)
that a transfer landed or was sent. Either end may `send` a message, `request` one and wait for the reply, and
`handle` messages by their `op`. The link closing (the other process died) fails every pending request and
calls the `on_close` callbacks, so no one waits on a dead rank.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("splitserve.engine.parallel_link")

_LEN = struct.Struct("<I")
MAX_MESSAGE = 64 << 20  # bytes of one JSON message

Handler = Callable[[dict], Any]  # returns the reply's fields (a dict) or None


class LinkClosed(ConnectionError):
    """The other end of the link is gone."""


class RankLink:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer  # for messages: "rank 1", "rank 0"
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self._handlers: dict[str, Handler] = {}
        self._on_close: list[Callable[[], None]] = []
        self.closed = False
        self._reader = threading.Thread(target=self._read_loop, name=f"link-{peer}", daemon=True)

    @classmethod
    def from_fd(cls, fd: int, peer: str) -> RankLink:
        return cls(socket.socket(fileno=fd), peer)

    def start(self) -> RankLink:
        self._reader.start()
        return self

    # -- registering ---------------------------------------------------------------------------------
    def handle(self, op: str, handler: Handler) -> None:
        """Run `handler(message)` on the link's reader thread for each message with this `op` (keep it short).
        A message that asks for a reply gets the handler's return value, or its exception as `error`."""
        self._handlers[op] = handler

    def on_close(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self.closed:
                self._on_close.append(callback)
                return
        callback()

    # -- sending -------------------------------------------------------------------------------------
    def send(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"link message of {len(data)} bytes is over {MAX_MESSAGE}")
        try:
            with self._send_lock:
                self.sock.sendall(_LEN.pack(len(data)) + data)
        except OSError as e:
            raise LinkClosed(f"{self.peer}: link closed ({e})") from None

    def request(self, message: dict, timeout: float = 10.0) -> dict:
        """Send and wait for the reply; raises LinkClosed, TimeoutError, or RuntimeError with the peer's error."""
        mid = next(self._ids)
        event, slot = threading.Event(), []
        with self._lock:
            if self.closed:
                raise LinkClosed(f"{self.peer}: link closed")
            self._waiting[mid] = (event, slot)
        try:
            self.send({**message, "id": mid})
            if not event.wait(timeout):
                raise TimeoutError(f"{self.peer}: no reply to {message.get('op')!r} in {timeout:.1f} s")
        finally:
            with self._lock:
                self._waiting.pop(mid, None)
        if not slot:
            raise LinkClosed(f"{self.peer}: link closed while waiting for a reply to {message.get('op')!r}")
        reply = slot[0]
        if reply.get("error"):
            raise RuntimeError(f"{self.peer}: {reply['error']}")
        return reply

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # -- the reader thread ---------------------------------------------------------------------------
    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise LinkClosed(self.peer)
            buf += chunk
        return bytes(buf)

    def _read_loop(self) -> None:
        try:
            while True:
                (n,) = _LEN.unpack(self._recv_exact(_LEN.size))
                if n > MAX_MESSAGE:
                    raise ValueError(f"message of {n} bytes")
                message = json.loads(self._recv_exact(n))
                self._dispatch(message)
        except (OSError, LinkClosed, ValueError) as e:
            if not isinstance(e, LinkClosed):
                log.warning("%s: link dropped: %s", self.peer, e)
        finally:
            self._closed()

    def _dispatch(self, message: dict) -> None:
        reply_to = message.get("reply_to")
        if reply_to is not None:
            with self._lock:
                entry = self._waiting.get(reply_to)
            if entry is not None:
                entry[1].append(message)
                entry[0].set()
            return
        handler = self._handlers.get(message.get("op", ""))
        mid = message.get("id")
        try:
            if handler is None:
                raise ValueError(f"no handler for {message.get('op')!r}")
            result = handler(message)
            reply = {"reply_to": mid, **(result or {})}
        except Exception as e:  # the requester gets the error; the link goes on
            if mid is None:
                log.warning("%s: %s failed: %s", self.peer, message.get("op"), e)
            reply = {"reply_to": mid, "error": str(e) or type(e).__name__}
        if mid is not None:
            try:
                self.send(reply)
            except LinkClosed:
                pass

    def _closed(self) -> None:
        with self._lock:
            self.closed = True
            waiting, self._waiting = list(self._waiting.values()), {}
            callbacks, self._on_close = self._on_close, []
        for event, _ in waiting:
            event.set()  # an empty slot: LinkClosed in request()
        for cb in callbacks:
            try:
                cb()
            except Exception as e:
                log.warning("%s: on_close callback failed: %s", self.peer, e)
