"""KV transfer's checks within one process, CPU tensors, for both backends (TCP and NIXL): tickets and layouts
that do not match are rejected, TCP frames outside their ticket or with a bad checksum fail the transfer, and the
engine's stream hook sends layer by layer. Between two real processes: tests/e2e/test_kv_transfer_peers.py.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time

import pytest
import torch
from support.kv_peer import SHAPE, make_kv

from splitserve.kv_transfer import (
    IncompatibleLayout,
    KVLayout,
    MalformedTicket,
    TransferError,
    TransferTicket,
    make_agent,
)

SEED = 1234


EXPECTED = make_kv(SEED)


def assert_landed(receiver, src: list[int], dst: list[int]) -> None:
    for layer in range(SHAPE["num_layers"]):
        for kv in (0, 1):
            got = receiver.layout.tensors[layer][kv][dst]
            want = EXPECTED[layer][kv][src]
            assert torch.equal(got, want), (layer, kv)


def assert_closed_by_peer(s: socket.socket) -> None:
    """The receiver closed the connection (EOF, or a reset when our unread bytes were discarded)."""
    s.settimeout(5)
    try:
        assert s.recv(16) == b""
    except ConnectionResetError:
        pass


def blocks(rng: random.Random, n: int, pool: int = SHAPE["num_blocks"]) -> list[int]:
    return rng.sample(range(pool), n)


@pytest.mark.parametrize("mutate", ["truncate", "garbage", "version", "blocks", "skip", "unknown-field", "b64"])
def test_corrupted_ticket_is_rejected(receiver, mutate):
    ticket = receiver.expect("req-t", [1, 2, 3], timeout_s=5)
    raw = ticket.encode()
    d = json.loads(raw)
    if mutate == "truncate":
        bad = raw[: len(raw) // 2]
    elif mutate == "garbage":
        bad = os.urandom(200)
    else:
        if mutate == "version":
            d["version"] = 99
        elif mutate == "blocks":
            d["block_ids"] = [1, 1, -3]
        elif mutate == "skip":
            d["skip_blocks"] = 3
        elif mutate == "unknown-field":
            d["pickle"] = "x"
        elif mutate == "b64":
            d["ranks"][0]["nixl_metadata"] = "***"
        bad = json.dumps(d).encode()
    with pytest.raises(MalformedTicket):
        TransferTicket.decode(bad)
    receiver.cancel("req-t")


def test_incompatible_layout_is_rejected(receiver, backend):
    other = make_agent(backend, KVLayout([(torch.zeros(8, 16, 2, 16), torch.zeros(8, 16, 2, 16))]))
    try:
        ticket = receiver.expect("req-x", [1, 2], timeout_s=5)
        with pytest.raises(IncompatibleLayout):
            other.begin(TransferTicket.decode(ticket.encode()), [1, 2])
    finally:
        other.close()
        receiver.cancel("req-x")


def test_tcp_frame_outside_its_ticket_is_refused():
    from splitserve.kv_transfer.tcp_backend import HEADER, KIND_DATA, MAGIC, RUN

    receiver = make_agent("tcp", KVLayout(make_kv(0, fill=False)))
    try:
        ticket = receiver.expect("req-o", [5, 6], timeout_s=3)
        host, _, port = ticket.ranks[0].endpoint.rpartition(":")
        bb = receiver.layout.block_bytes
        rid = b"req-o"
        head = HEADER.pack(MAGIC, KIND_DATA, 1, 0, 0, len(rid), 1, 0, SHAPE["heads"], 0, 1, bb, 0)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(head + rid + RUN.pack(50, 1) + b"\x01" * bb)  # block 50 is not in the ticket
            assert_closed_by_peer(s)
        assert torch.count_nonzero(receiver.layout.tensors[0][0][50]) == 0
        with pytest.raises(TransferError):
            receiver.wait_blocking("req-o")  # the connection that carried it dropped: fails fast
    finally:
        receiver.close()


def test_tcp_checksum_mismatch_fails_the_transfer():
    from splitserve.kv_transfer.tcp_backend import HEADER, KIND_DATA, MAGIC, RUN

    receiver = make_agent("tcp", KVLayout(make_kv(0, fill=False)))
    try:
        ticket = receiver.expect("req-c", [5], timeout_s=5)
        host, _, port = ticket.ranks[0].endpoint.rpartition(":")
        bb = receiver.layout.block_bytes
        rid = b"req-c"
        head = HEADER.pack(MAGIC, KIND_DATA, 1, 0, 0, len(rid), 1, 0, SHAPE["heads"], 0, 1, bb, 12345)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(head + rid + RUN.pack(5, 1) + b"\x01" * bb)
            assert_closed_by_peer(s)
        with pytest.raises(TransferError, match="checksum"):
            receiver.wait_blocking("req-c")
    finally:
        receiver.close()


def test_stream_hook_sends_chunks_layer_by_layer(receiver, backend):
    """The engine-side hook: chunked prefill steps stream touched blocks per layer; final chunk completes."""
    from splitserve.engine.scheduler import ScheduledRequest
    from splitserve.kv_transfer.stream_hook import KVStreamHook

    sender = make_agent(backend, KVLayout(make_kv(SEED)))
    try:
        rng = random.Random(7)
        n_tokens = 16 * 6 - 5
        src, dst = blocks(rng, 6), blocks(rng, 6)
        ticket = receiver.expect("req-h", dst, skip_blocks=1, timeout_s=20)
        hook = KVStreamHook(block_size=16)
        session = sender.begin(TransferTicket.decode(ticket.encode()), src)
        done = hook.register("req-h", session, n_tokens)

        class R:
            request_id = "req-h"

        for start, n in ((0, 40), (40, 40), (80, n_tokens - 80)):
            sched = [ScheduledRequest(R(), n, start, src, False)]
            hook.on_step_begin(sched)
            for layer in range(SHAPE["num_layers"]):
                hook.on_layer_written(layer)
            hook.on_step_end(sched)
            if start == 0:
                time.sleep(0.3)
                assert receiver.progress("req-h") == 0  # not final yet
        assert done.is_set()
        receiver.wait_blocking("req-h")  # lands without the sender's finish(): in-flight writes are polled
        session.finish()
        assert_landed(receiver, src[1:], dst[1:])
    finally:
        sender.close()


def test_stream_hook_keeps_layers_written_before_the_ticket_and_sends_them_when_it_comes(receiver, backend):
    """A prefill worker computes before the decode side's ticket comes: the layers written meanwhile are kept and
    sent by `attach`, in order with the ones written after (here it comes halfway through the second chunk)."""
    from splitserve.engine.scheduler import ScheduledRequest
    from splitserve.kv_transfer.stream_hook import KVStreamHook

    sender = make_agent(backend, KVLayout(make_kv(SEED)))
    try:
        rng = random.Random(11)
        n_tokens = 16 * 6 - 3
        src, dst = blocks(rng, 6), blocks(rng, 6)
        came: list[TransferTicket] = []
        hook = KVStreamHook(block_size=16)
        done = hook.register("req-late", lambda ours: sender.begin(came[0], ours) if came else None, n_tokens)

        class R:
            request_id = "req-late"

        half = SHAPE["num_layers"] // 2
        for start, n in ((0, 40), (40, 40), (80, n_tokens - 80)):
            sched = [ScheduledRequest(R(), n, start, src, False)]
            hook.on_step_begin(sched)
            for layer in range(SHAPE["num_layers"]):
                if start == 40 and layer == half:
                    assert hook.session("req-late") is None
                    came.append(TransferTicket.decode(receiver.expect("req-late", dst, timeout_s=20).encode()))
                    hook.attach("req-late")
                hook.on_layer_written(layer)
            hook.on_step_end(sched)
        assert done.is_set() and hook.error("req-late") is None
        hook.session("req-late").finish()
        receiver.wait_blocking("req-late")
        assert_landed(receiver, src, dst)

        bad = KVStreamHook(block_size=16)  # a ticket that fails when it comes fails the stream, not the engine
        failed = bad.register("req-bad", lambda ours: (_ for _ in ()).throw(MalformedTicket("no")) if came else None,
                              16)
        sched = [ScheduledRequest(type("R", (), {"request_id": "req-bad"})(), 16, 0, src[:1], False)]
        bad.on_step_begin(sched)
        bad.on_layer_written(0)
        bad.attach("req-bad")
        assert failed.is_set() and isinstance(bad.error("req-bad"), TransferError)
        for layer in range(1, SHAPE["num_layers"]):
            bad.on_layer_written(layer)
        bad.on_step_end(sched)
    finally:
        sender.close()
