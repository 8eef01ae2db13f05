"""Layer-wise NIXL sending, sender and receivers as agents in this process (CPU tensors, real NIXL over UCX):
writes carry no notification, one notice per request and route follows once every write completed; runs of
blocks contiguous on both sides go in descriptors of CHUNK_BYTES; the receiver checks every notice's fields."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from splitserve.engine.parallel import KVShard, kv_head_range
from splitserve.kv_transfer import KVLayout, TransferTicket, TransferTimeout, make_agent
from splitserve.kv_transfer.shards import plan_routes, receivers

LAYERS, BLOCKS, BS, HEADS, DIM = 4, 40, 4, 2, 8
BLOCK_BYTES = BS * HEADS * DIM * 4  # one block of K (or V) of one layer, float32, every head


@pytest.fixture(autouse=True)
def _needs_nixl():
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        pytest.fail("NIXL is not installed: `make test` installs it (nixl + nixl-cu13 wheels)")


@pytest.fixture
def nb(monkeypatch):
    from splitserve.kv_transfer import nixl_backend, nixl_channel

    monkeypatch.setattr(nixl_channel, "PROGRESS_S", 0.0)  # the request's notice only
    monkeypatch.setattr(nixl_backend, "CHUNK_BYTES", 3 * BLOCK_BYTES)
    return nixl_backend


def kv(heads: int, seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed or 0)
    shape = (BLOCKS, BS, heads, DIM)
    make = (lambda: torch.randn(shape, generator=g)) if seed is not None else (lambda: torch.zeros(shape))
    return [(make(), make()) for _ in range(LAYERS)]


# a run of 7 blocks contiguous on both sides (3 + 3 + 1 blocks a descriptor), one of 2, and single blocks
SRC = [30, 2, 3, 4, 5, 6, 7, 8, 17, 12, 13, 0]
DST = [5, 20, 21, 22, 23, 24, 25, 26, 1, 33, 34, 9]
DESCS_PER_LAYER = 2 * (3 + 1 + 1 + 1)  # K and V: [2-4, 5-7, 8], [17], [12-13], [0] (block 30 is skipped)


def _send(sender, ticket: TransferTicket, src: list[int]) -> None:
    session = sender.begin(TransferTicket.decode(ticket.encode()), src)
    for layer in range(LAYERS):
        session.send_layer(layer)
    session.finish()


def test_layers_land_with_one_notice_and_chunked_descriptors(nb, monkeypatch):
    recv = make_agent("nixl", KVLayout(kv(HEADS, None)))
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")  # read when the agent starts: descriptors per write
    send = make_agent("nixl", KVLayout(kv(HEADS, 7)))
    merged: list[int] = []  # descriptors of each write after NIXL's merging, from its telemetry
    real_release = send.backend.nixl.release_xfer_handle

    def release(handle):
        merged.append(send.backend.nixl.get_xfer_telemetry(handle).descCount)
        return real_release(handle)

    send.backend.nixl.release_xfer_handle = release
    try:
        for i in range(3):
            rid = f"req-{i}"
            before = dict(send.backend.counts), recv.backend.counts["notifs_received"]
            ticket = recv.expect(rid, DST, skip_blocks=1, timeout_s=20)
            _send(send, ticket, SRC)
            recv.wait_blocking(rid)
            for layer in range(LAYERS):
                for t in (0, 1):
                    got = recv.layout.tensors[layer][t]
                    assert torch.equal(got[DST[1:]], send.layout.tensors[layer][t][SRC[1:]]), (layer, t)
                    assert torch.count_nonzero(got[DST[0]]) == 0  # the skipped block
            sent = {k: v - before[0].get(k, 0) for k, v in send.backend.counts.items()}
            assert sent == {"xfers": LAYERS, "descs": LAYERS * DESCS_PER_LAYER, "notifs": 1}, sent
            assert recv.backend.counts["notifs_received"] - before[1] == 1
            recv.forget(rid)
        # NIXL made exactly the descriptors we cut (it merges adjacent entries contiguous on both sides)
        assert merged == [DESCS_PER_LAYER] * (3 * LAYERS), merged
    finally:
        send.close()
        recv.close()


def _sharded_case(heads: int, p: int, d: int, ring_blocks: int, monkeypatch) -> None:
    """p sending ranks into d receiving ranks; a ring of `ring_blocks` blocks of a one-head slab."""
    from splitserve.kv_transfer import staging

    monkeypatch.setattr(staging, "STAGING_BYTES", ring_blocks * BS * DIM * 4)
    full = kv(heads, 11)

    def shard(r: int, world: int, fill: bool):
        h = kv_head_range(heads, r, world)
        return [tuple((t[:, :, h.start : h.stop].contiguous() if fill else torch.zeros_like(t[:, :, h.start : h.stop]))
                      for t in pair) for pair in full]

    recv = [make_agent("nixl", KVLayout(shard(r, d, False), KVShard.of(heads, r, d))) for r in range(d)]
    send = [make_agent("nixl", KVLayout(shard(r, p, True), KVShard.of(heads, r, p))) for r in range(p)]
    try:
        rid, deadline = f"req-{heads}-{p}-{d}", time.time() + 20
        ticket = TransferTicket.decode(recv[0].make_ticket(rid, DST, 1, deadline, [a.endpoint() for a in recv]).encode())
        receiving = receivers(heads, d)
        for r in receiving:
            recv[r].expect_local(rid, DST, 1, deadline)
        got_before = [a.backend.counts["notifs_received"] for a in recv]
        sessions = [a.begin(ticket, SRC) for a in send]
        for layer in range(LAYERS):
            for s in sessions:
                s.send_layer(layer)
        for s in sessions:
            s.finish()
        for r in receiving:
            recv[r].wait_blocking(rid)
        for r in range(d):
            h = kv_head_range(heads, r, d)
            for layer in range(LAYERS):
                for t in (0, 1):
                    got = recv[r].layout.tensors[layer][t]
                    if r in receiving:
                        assert torch.equal(got[DST[1:]], full[layer][t][SRC[1:], :, h.start : h.stop]), (r, layer, t)
        routes = plan_routes(heads, p, d)
        for r in range(d):  # one notice per route, whatever the layers and writes
            notices = recv[r].backend.counts["notifs_received"] - got_before[r]
            assert notices == sum(route.dst_rank == r for route in routes), (r, notices)
    finally:
        for a in send + recv:
            a.close()


@pytest.mark.parametrize("heads,p,d", [(2, 1, 2), (4, 1, 2), (4, 2, 4), (4, 2, 1)])
def test_head_slabs_land_through_a_small_staging_ring_with_one_notice_per_route(nb, monkeypatch, heads, p, d):
    """(2,1,2), (4,1,2), (4,2,4): staged slabs (a ring of 6 blocks, so writes wait for slots and wrap); (4,2,1):
    per-token descriptors into a receiver holding more heads than the slab."""
    _sharded_case(heads, p, d, 6, monkeypatch)


def test_a_layer_never_final_leaves_the_request_to_its_deadline(nb, monkeypatch):
    """Progress notices name landed layers, but the request completes only on the request's notice."""
    from splitserve.kv_transfer import nixl_channel

    monkeypatch.setattr(nixl_channel, "PROGRESS_S", 1e-3)
    recv = make_agent("nixl", KVLayout(kv(HEADS, None)))
    send = make_agent("nixl", KVLayout(kv(HEADS, 7)))
    try:
        ticket = recv.expect("req-partial", DST, timeout_s=1.5)
        session = send.begin(TransferTicket.decode(ticket.encode()), SRC)
        for layer in range(LAYERS):
            session.send_layer(layer, final=layer != LAYERS - 1)
        session.finish()
        t0 = time.monotonic()
        while recv.progress("req-partial") < LAYERS - 1 and time.monotonic() - t0 < 1.0:
            time.sleep(0.01)
        assert recv.progress("req-partial") == LAYERS - 1  # progress notices arrived, the last layer is not final
        with pytest.raises(TransferTimeout):
            recv.wait_blocking("req-partial")
        assert time.monotonic() - t0 < 3.0
    finally:
        send.close()
        recv.close()


@pytest.mark.parametrize("notice", [
    b"L|9|1|0|0|1|req-m",  # layer out of range
    b"L|-2|1|0|0|1|req-m",
    b"L|+1|1|0|0|1|req-m",  # a sign
    b"L|1,,2|1|0|0|1|req-m",
    b"L|0|2|0|0|1|req-m",  # final flag
    b"L|-1|1|-5|0|1|req-m",  # negative bytes
    b"L|-1|1|1_0|0|1|req-m",
    b"L|-1|1|99999999999|0|1|req-m",  # more bytes than the request's blocks hold
    b"L|-1|1|0|0|0|req-m",  # no senders
    b"L|-1|1|0|5000|1|req-m",
    b"L|-1|1|0|0|1",  # a field missing
    b"X|-1|1|0|0|1|req-m",
    b"L|-1|1|0|0|1|req-m\xff",
])
def test_malformed_notices_are_dropped_with_a_log_line(notice, caplog):
    recv = make_agent("nixl", KVLayout(kv(HEADS, None)))
    try:
        recv.expect("req-m", DST, timeout_s=5)
        with caplog.at_level(logging.WARNING, logger="splitserve.kv_transfer.nixl"):
            recv.backend._on_notif(recv, notice)
        assert "malformed notification" in caplog.text
        assert recv.is_expected("req-m") and recv.progress("req-m") == 0
        recv.backend._on_notif(recv, b"L|0,2|1|64|0|1|req-m")  # a progress notice: layers 0 and 2
        assert recv.progress("req-m") == 2
        recv.backend._on_notif(recv, b"L|-1|1|64|0|1|req-m")
        recv.wait_blocking("req-m")
    finally:
        recv.close()
