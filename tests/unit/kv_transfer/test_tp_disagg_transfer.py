"""KV streaming between sharded workers, the movers alone: p sending ranks and d receiving ranks (one agent each
over its own KV-head shard, in this process) for p, d in {1, 2, 4}, over TCP and NIXL. Every receiving rank
ends up with exactly its heads of the full KV and nothing else; replicated heads are sent once. Also the
routing arithmetic, the step plan's encoding and the rank link."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import threading
import time

import pytest
import torch

from splitserve.engine.parallel import KVShard, kv_head_range
from splitserve.engine.parallel_link import LinkClosed, RankLink
from splitserve.kv_transfer import KVLayout, TransferTicket, make_agent
from splitserve.kv_transfer.sharded import PlanEntry, decode_plan
from splitserve.kv_transfer.shards import plan_routes, receivers

LAYERS, BLOCKS, BS, DIM = 3, 24, 4, 8


def _nixl() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


def full_kv(heads: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BS, heads, DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(LAYERS)]


def shard_of(kv, heads: int, rank: int, world: int, fill: bool):
    """This rank's KV: its heads of `kv` (a copy), or zeros."""
    r = kv_head_range(heads, rank, world)
    return [tuple((t[:, :, r.start : r.stop].clone() if fill else torch.zeros_like(t[:, :, r.start : r.stop]))
                  for t in pair) for pair in kv]


def test_routes_send_each_head_once_to_its_first_holder():
    for heads, p, d in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 4)):
        if (heads >= p and heads % p) or (heads < p and p % heads) or (heads >= d and heads % d) \
                or (heads < d and d % heads):
            continue
        routes = plan_routes(heads, p, d)
        sent = sorted(h for r in routes for h in range(r.head_start, r.head_start + r.num_heads))
        assert sent == list(range(heads)), (heads, p, d)  # every head exactly once
        assert {r.dst_rank for r in routes} == set(receivers(heads, d))
        for r in routes:
            assert r.head_start in kv_head_range(heads, r.src_rank, p)
            assert r.head_start - kv_head_range(heads, r.dst_rank, d).start == r.dst_offset
            assert r.num_src == len({x.src_rank for x in routes if x.dst_rank == r.dst_rank})
    assert receivers(2, 4) == [0, 2]  # ranks 1 and 3 copy their head from ranks 0 and 2


def test_step_plan_round_trip_and_rejects_garbage():
    entries = [PlanEntry(3, 0, 2, False, [7, 9]), PlanEntry(4, 1, 3, True, [1, 2, 5])]
    plan = [x for e in entries for x in e.encode()]
    assert decode_plan(plan) == entries
    for bad in (plan[:-1], plan[:3], [1, 5, 2, 0, 1, 9]):
        with pytest.raises(ValueError):
            decode_plan(bad)


def test_rank_link_request_reply_handlers_and_closing():
    a, b = socket.socketpair()
    left, right = RankLink(a, "right"), RankLink(b, "left")
    right.handle("add", lambda m: {"sum": m["x"] + m["y"]})
    right.handle("boom", lambda m: 1 / 0)
    got: list[dict] = []
    left.handle("note", got.append)
    closed = threading.Event()
    left.on_close(closed.set)
    left.start(), right.start()
    assert left.request({"op": "add", "x": 2, "y": 3})["sum"] == 5
    with pytest.raises(RuntimeError, match="division"):
        left.request({"op": "boom"})
    right.send({"op": "note", "n": 1})
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got and got[0]["n"] == 1
    right.close()
    assert closed.wait(5)
    with pytest.raises(LinkClosed):
        left.request({"op": "add", "x": 1, "y": 1}, timeout=2)


CASES = [(4, p, d) for p in (1, 2, 4) for d in (1, 2, 4)] + [(2, 4, 1), (2, 1, 4), (2, 2, 4), (2, 4, 2)]


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_sharded_senders_fill_exactly_each_receivers_shard(backend):
    if backend == "nixl" and not _nixl():
        pytest.fail("NIXL is not installed: `make test` installs it (nixl + nixl-cu13 wheels)")
    for heads, p, d in CASES:
        _one_case(backend, heads, p, d)


def _one_case(backend: str, heads: int, p: int, d: int) -> None:
    kv = full_kv(heads)
    recv = [make_agent(backend, KVLayout(shard_of(kv, heads, r, d, False), KVShard.of(heads, r, d)))
            for r in range(d)]
    send = [make_agent(backend, KVLayout(shard_of(kv, heads, r, p, True), KVShard.of(heads, r, p)))
            for r in range(p)]
    try:
        src, dst = [3, 4, 5, 11, 0, 17], [20, 1, 2, 3, 9, 8]  # runs contiguous on both sides, and not
        rid = f"req-{heads}-{p}-{d}"
        deadline = time.time() + 20
        ticket = recv[0].make_ticket(rid, dst, 1, deadline, [a.endpoint() for a in recv])
        ticket = TransferTicket.decode(ticket.encode())
        receiving = receivers(heads, d)
        for r in receiving:
            recv[r].expect_local(rid, dst, 1, deadline)
        sessions = [a.begin(ticket, src[:4]) for a in send]  # the block list grows, as in chunked prefill
        for layer in range(LAYERS):
            for s in sessions:
                s.send_layer(layer, range(0, 4), final=False)
        for s in sessions:
            s.src_block_ids = src
        for layer in range(LAYERS):
            for s in sessions:
                s.send_layer(layer, range(3, 6), final=True)
        for s in sessions:
            s.finish()

        async def landed():
            await asyncio.gather(*(recv[r].wait(rid) for r in receiving))

        asyncio.run(asyncio.wait_for(landed(), 20))
        for r in range(d):
            heads_r = kv_head_range(heads, r, d)
            for layer in range(LAYERS):
                for i in (0, 1):
                    got = recv[r].layout.tensors[layer][i]
                    if r in receiving:
                        want = kv[layer][i][src[1:], :, heads_r.start : heads_r.stop]
                        assert torch.equal(got[dst[1:]], want), (heads, p, d, r, layer, i)
                        assert torch.count_nonzero(got[dst[0]]) == 0  # the skipped prefix block
                    else:
                        assert torch.count_nonzero(got) == 0  # shares a head: copies it, never receives
        n_bytes = sum(s.bytes for s in sessions)
        assert n_bytes == 2 * LAYERS * 6 * BS * heads * DIM * 4  # blocks 1-3, then 3-5: each head once
    finally:
        for a in send + recv:
            a.close()


def test_a_head_slab_goes_in_whole_blocks_through_the_staging_ring(monkeypatch):
    """Prefill TP=1 into decode TP=2 or 4 (or 2 into 4): each route carries a slab of the sender's heads. Its
    writes name whole blocks of a staging ring (K and V of each block: 2 entries), never one entry per token (which
    cost ~0.8 s of the sender thread per 1k-token request on H200s). A ring of a few blocks makes the writes
    split, wait for room and wrap; every receiver still gets exactly its heads."""
    if not _nixl():
        pytest.fail("NIXL is not installed: `make test` installs it (nixl + nixl-cu13 wheels)")
    from splitserve.kv_transfer import staging

    monkeypatch.setattr(staging, "STAGING_BYTES", 40 * BS * 2 * DIM * 4)  # 40 blocks, 2 heads
    entries: list[int] = []
    real_make_agent = make_agent

    def spying_make_agent(*args, **kwargs):
        agent = real_make_agent(*args, **kwargs)
        nx = agent.backend.nixl
        make_xfer = nx.make_prepped_xfer

        def spy(op, local_prep, local, remote_prep, remote, *rest):
            entries.append(len(local))
            return make_xfer(op, local_prep, local, remote_prep, remote, *rest)

        nx.make_prepped_xfer = spy
        return agent

    monkeypatch.setitem(globals(), "make_agent", spying_make_agent)
    for heads, p, d in ((4, 1, 2), (4, 1, 4), (2, 1, 4), (4, 2, 4)):
        entries.clear()
        _one_case("nixl", heads, p, d)
        routes = plan_routes(heads, p, d)
        # _one_case sends blocks 1-3, then 3-5 of every layer: 3 blocks a write, or 2 + 1 where the ring holds
        # 40 blocks of a 2-head slab (parts of an eighth: 2 blocks, K and V)
        writes = 4 if routes[0].num_heads == 2 else 2
        assert sum(entries) == len(routes) * LAYERS * 2 * 6, (heads, p, d, entries)
        assert len(entries) == len(routes) * LAYERS * writes, (heads, p, d, entries)


def test_staging_ring_slots_never_overlap():
    from splitserve.kv_transfer.staging import StagingRing

    class Unregistered:  # the ring's arithmetic alone
        def register_memory(self, descs):
            return None

        def get_reg_descs(self, tensors):
            return None

    ring = StagingRing(Unregistered(), KVLayout(full_kv(1)), 1000)
    live, rng = [], random.Random(3)
    for _ in range(2000):
        if live and (rng.random() < 0.5 or len(live) > 6):
            ring.give(live.pop(rng.randrange(min(2, len(live)))))  # mostly the oldest first, as writes finish
        slot = ring.take(rng.choice((8, 48, 200, 400)), 8)
        if slot is not None:
            assert slot.start % 8 == 0 and slot.end <= 1000
            assert all(slot.end <= s.start or s.end <= slot.start for s in live), (slot, live)
            live.append(slot)
    for slot in live:
        ring.give(slot)
    assert ring.take(1000, 8) is not None  # all given back: the whole ring again
