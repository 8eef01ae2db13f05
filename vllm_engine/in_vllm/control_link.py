"""A connector's line to the worker beside its vLLM server: a ZMQ DEALER connected to the worker's control
endpoint (loopback), owned by one thread that says hello every `HELLO_S` (so a worker that restarted learns who
listens), forwards what other threads `send` (each through a PUSH socket of its own into an inproc queue: a ZMQ
socket never crosses threads) and hands each message that arrives to a callback. A worker that is not listening
costs nothing: the DEALER queues nothing for a peer that is not there (the worker never depends on a message it
missed: every reservation and transfer also ends by its deadline).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from splitserve.vllm_engine.in_vllm.layerwise_wire import HELLO_S, WireError, decode_message, encode_message

log = logging.getLogger("splitserve.vllm_layerwise")

Handler = Callable[[str, dict[str, Any]], None]
_IDS = itertools.count()


class ControlLink:
    def __init__(self, endpoint: str, side: str, dp: int, rank: int, engine: str, handler: Handler | None) -> None:
        self._hello = dict(side=side, dp=dp, rank=rank, engine=engine, pid=os.getpid())
        self._handler = handler
        self._ctx = zmq.Context.instance()
        self._inproc = f"inproc://splitserve-control-{os.getpid()}-{next(_IDS)}"
        self._queue = self._ctx.socket(zmq.PULL)  # what other threads send, for our thread to forward
        self._queue.setsockopt(zmq.LINGER, 0)
        self._queue.bind(self._inproc)
        self._local = threading.local()  # each sending thread's PUSH socket
        self._pushes: list[zmq.Socket] = []
        self._pushes_lock = threading.Lock()
        self._endpoint = endpoint
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"splitserve-control-{side}", daemon=True)
        self._thread.start()

    def send(self, kind: str, **fields: Any) -> None:
        """Queue a message for the worker (from any thread; never blocks)."""
        raw = encode_message(kind, **fields)
        if self._closed.is_set():
            return
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self._inproc)
            self._local.push = push
            with self._pushes_lock:
                self._pushes.append(push)
        try:
            push.send(raw, zmq.NOBLOCK)
        except zmq.Again:  # thousands queued: the link thread is stuck, and the worker learns by deadlines
            log.debug("control: %s not queued", kind)

    def _run(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a worker that is not there
        dealer.connect(self._endpoint)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._queue, zmq.POLLIN)
        hello = encode_message("hello", **self._hello)
        next_hello = 0.0
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if now >= next_hello:
                    _send(dealer, hello)
                    next_hello = now + HELLO_S
                events = dict(poller.poll(timeout=int(1000 * min(0.2, max(0.0, next_hello - now))) or 1))
                if self._queue in events:
                    while (raw := _recv(self._queue)) is not None:
                        _send(dealer, raw)
                if dealer in events:
                    while (raw := _recv(dealer)) is not None:
                        self._deliver(raw)
        finally:
            dealer.close(linger=0)

    def _deliver(self, raw: bytes) -> None:
        try:
            kind, fields = decode_message(raw)
        except WireError as e:
            log.warning("control: dropped a message from the worker: %s", e)
            return
        if self._handler is not None:
            self._handler(kind, fields)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)
        self._queue.close(linger=0)
        with self._pushes_lock:  # sockets of threads that may be gone; closing them here is safe once unused
            for push in self._pushes:
                push.close(linger=0)
            self._pushes.clear()


def _send(sock: zmq.Socket, raw: bytes) -> None:
    try:
        sock.send(raw, zmq.NOBLOCK)
    except zmq.Again:  # the worker is not listening (restarting, or gone): it learns by deadlines
        pass


def _recv(sock: zmq.Socket) -> bytes | None:
    try:
        return sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
