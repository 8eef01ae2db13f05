"""KV transfer between two real processes on loopback, CPU tensors, for both backends (TCP and NIXL).

The sender runs in `kv_peer.py` (its own process, seeded random KV); this process is the receiver. A peer or
benchmark receiver that dies is reported at once, not waited on.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.kv_peer import SHAPE, Peer, PeerDied, make_kv

from splitserve.kv_transfer import (
    IncompatibleLayout,
    KVLayout,
    MalformedTicket,
    TransferCancelled,
    TransferError,
    TransferTicket,
    TransferTimeout,
    make_agent,
)

pytestmark = pytest.mark.slow

BACKENDS = ["tcp", "nixl"]
SEED = 1234


def _nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "nixl" and not _nixl_available():
        pytest.fail("NIXL is not installed: `make test` installs it (nixl + nixl-cu13 wheels)")
    return request.param


@pytest.fixture
def receiver(backend):
    agent = make_agent(backend, KVLayout(make_kv(0, fill=False)))
    assert agent.backend.name == backend
    yield agent
    agent.close()


@pytest.fixture
def peer(backend):
    p = Peer(backend, SEED)
    yield p
    p.close()


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


def test_bit_exact_layer_by_layer_any_block_order(receiver, peer):
    rng = random.Random(1)
    src = rng.sample([b for b in range(SHAPE["num_blocks"]) if not 40 <= b < 46], 14)
    dst = rng.sample([b for b in range(SHAPE["num_blocks"]) if not 70 <= b < 76], 14)
    src[3:3] = range(40, 46)  # a run contiguous on both sides (coalesced into one descriptor)
    dst[3:3] = range(70, 76)
    ticket = receiver.expect("req-1", dst, timeout_s=20)
    layers = list(range(SHAPE["num_layers"]))
    rng.shuffle(layers)
    peer.send(ticket, src, layers=layers, delay=0.15)
    seen = set()
    while receiver.progress("req-1") < SHAPE["num_layers"]:
        seen.add(receiver.progress("req-1"))
        time.sleep(0.01)
    receiver.wait_blocking("req-1")
    assert len(seen - {0}) >= 2, f"per-layer progress never visible: {seen}"
    assert_landed(receiver, src, dst)
    assert peer.read()["done"] == "req-1"
    receiver.forget("req-1")
    assert receiver.num_pending == 0


def test_skipped_prefix_blocks_are_not_written(receiver, peer):
    rng = random.Random(2)
    src, dst = blocks(rng, 10), blocks(rng, 10)
    ticket = receiver.expect("req-skip", dst, skip_blocks=4, timeout_s=20)
    peer.send(ticket, src)
    receiver.wait_blocking("req-skip")
    assert_landed(receiver, src[4:], dst[4:])
    for b in dst[:4]:
        assert torch.count_nonzero(receiver.layout.tensors[0][0][b]) == 0


def test_sixteen_concurrent_requests(receiver, peer):
    rng = random.Random(3)
    dst_pool = rng.sample(range(SHAPE["num_blocks"]), 16 * 5)
    jobs = []
    for i in range(16):
        src = blocks(rng, 5)
        dst = dst_pool[i * 5 : (i + 1) * 5]
        ticket = receiver.expect(f"c{i}", dst, timeout_s=30)
        jobs.append((f"c{i}", src, dst, ticket))
    for _, src, _, ticket in jobs:
        peer.send(ticket, src)

    async def wait_all():
        await asyncio.gather(*(receiver.wait(rid) for rid, *_ in jobs))

    asyncio.run(wait_all())
    for _, src, dst, _ in jobs:
        assert_landed(receiver, src, dst)
    assert receiver.num_pending == 0


def test_cancel_mid_stream_releases_everything(receiver, peer):
    rng = random.Random(4)
    src, dst = blocks(rng, 8), blocks(rng, 8)
    ticket = receiver.expect("req-cancel", dst, timeout_s=20)
    peer.send(ticket, src, delay=0.3)
    while receiver.progress("req-cancel") < 1:
        time.sleep(0.01)
    receiver.cancel("req-cancel")
    with pytest.raises(TransferCancelled):
        receiver.wait_blocking("req-cancel")
    assert receiver.num_pending == 0
    # later frames for the cancelled request are refused; the agent keeps working
    src2, dst2 = blocks(rng, 4), blocks(rng, 4)
    t2 = receiver.expect("req-after", dst2, timeout_s=20)
    peer.send(t2, src2)
    receiver.wait_blocking("req-after")
    assert_landed(receiver, src2, dst2)


def test_sender_killed_mid_stream_fails_within_deadline(receiver, peer):
    rng = random.Random(5)
    src, dst = blocks(rng, 8), blocks(rng, 8)
    deadline_s = 3.0
    ticket = receiver.expect("req-kill", dst, timeout_s=deadline_s)
    peer.send(ticket, src, delay=0.4)
    while receiver.progress("req-kill") < 1:
        time.sleep(0.01)
    t0 = time.monotonic()
    peer.kill()

    async def wait():
        await receiver.wait("req-kill")

    with pytest.raises(TransferError):
        asyncio.run(asyncio.wait_for(wait(), deadline_s + 2))
    assert time.monotonic() - t0 <= deadline_s + 0.5
    assert receiver.num_pending == 0


def test_stalled_sender_times_out(receiver, peer):
    rng = random.Random(6)
    src, dst = blocks(rng, 4), blocks(rng, 4)
    ticket = receiver.expect("req-stall", dst, timeout_s=1.5)
    peer.send(ticket, src, stop_after=2)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        receiver.wait_blocking("req-stall")
    assert time.monotonic() - t0 < 3.0
    assert receiver.num_pending == 0


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


def test_garbage_on_the_tcp_port_is_dropped_and_serving_continues():
    receiver = make_agent("tcp", KVLayout(make_kv(0, fill=False)))
    peer = Peer("tcp", SEED)
    try:
        ticket = receiver.expect("req-g", [5, 6], timeout_s=20)
        host, _, port = ticket.ranks[0].endpoint.rpartition(":")
        for payload in (os.urandom(4096), b"SKV2" + os.urandom(60), b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(payload)
                assert_closed_by_peer(s)
        assert receiver.is_expected("req-g")  # an unrelated transfer is unaffected
        peer.send(ticket, [7, 8])
        receiver.wait_blocking("req-g")
        assert_landed(receiver, [7, 8], [5, 6])
    finally:
        peer.close()
        receiver.close()


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


# == a dead peer is reported, not waited on ========================================================
ROOT = Path(__file__).resolve().parents[2]


def test_peer_that_dies_at_start_is_reported_at_once():
    t0 = time.monotonic()
    with pytest.raises(PeerDied, match=r"exited with code 1(.|\n)*ValueError(.|\n)*no-such-backend"):
        Peer("no-such-backend", SEED)
    assert time.monotonic() - t0 < 20  # a Python start with torch; the wait for "ready" allows 60 s


def test_peer_killed_later_is_reported_at_once():
    peer = Peer("tcp", SEED)
    try:
        os.kill(peer.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerDied, match="exited with code -9"):
            peer.read(timeout=30)
        assert time.monotonic() - t0 < 2
    finally:
        peer.close()


def test_benchmark_reports_a_receiver_that_dies_at_start(tmp_path):
    """`kv_transfer.py --backend nixl` without NIXL: the receiver dies at start and the parent says so."""
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text('raise ImportError("NIXL is not installed here")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    cmd = [sys.executable, "benchmarks/kv_transfer.py", "--backend", "nixl", "--cases", "smollm2_2k",
           "--reps", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert res.returncode != 0
    assert "exited with code 1" in res.stderr, res.stderr[-2000:]
    assert "NIXL is not installed here" in res.stderr, res.stderr[-2000:]
    assert time.monotonic() - t0 < 30  # it used to wait for an outer timeout
