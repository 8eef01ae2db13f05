"""The gateways' KV index, the Redis wire formats and the kv_aware policy, as plain objects (hand-made events and
worker views), like the scheduler's tests."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.common.redis_wire import (
    KVEventRecord,
    RegistryEntry,
    WireError,
    decode_load,
    decode_snapshot,
    encode_load,
    encode_snapshot,
)
from splitserve.router.kv_index import KVIndex, Match
from splitserve.router.policy import KVAware, RequestFeatures, WorkerLoad


def rec(worker, kind, hashes, tier="gpu", instance="i1") -> KVEventRecord:
    return KVEventRecord(worker, instance, kind, tier, np.asarray(hashes, dtype=np.uint64))


def test_index_matches_longest_prefix_per_worker_with_pool_tier():
    idx = KVIndex()
    idx.apply(rec("a", "stored", [1, 2, 3, 4]))
    idx.apply(rec("b", "stored", [1, 2]))
    idx.apply(rec("pool", "stored", [1, 2, 3, 4, 5, 6], tier="pool", instance="pool"))
    matches, pool = idx.match([1, 2, 3, 4, 5, 6, 7], [("a", "i1"), ("b", "i1"), ("c", "i1")])
    assert pool == 6
    assert matches == {"a": Match(4, 2), "b": Match(2, 4)}
    idx.apply(rec("a", "removed", [3]))
    assert idx.match([1, 2, 3, 4], [("a", "i1")])[0]["a"] == Match(2, 2)
    idx.apply(rec("a", "cleared", []))
    assert idx.match([1, 2], [("a", "i1")])[0]["a"] == Match(0, 2)
    assert idx.num_blocks == 2  # b's blocks


def test_restart_under_the_same_name_drops_the_old_instance():
    idx = KVIndex()
    idx.apply(rec("a", "stored", [1, 2, 3], instance="old"))
    assert not idx.apply(rec("a", "stored", [9], instance="old"), live={"a": "new"})  # a late event: stale
    removed = idx.retain({"a": "new"})
    assert removed == 3 and idx.num_blocks == 0
    idx.apply(rec("a", "stored", [1], instance="new"))
    assert idx.match([1, 2], [("a", "new")])[0]["a"] == Match(1, 0)
    assert idx.match([1, 2], [("a", "old")])[0] == {}


def test_snapshot_round_trip_and_rejections():
    idx = KVIndex()
    idx.apply(rec("a", "stored", [1, 2, 3]))
    idx.apply(rec("b", "stored", [2, 7], instance="x"))
    raw = encode_snapshot("1700000000000-3", idx.sections())
    stream_id, sections = decode_snapshot(raw)
    back = KVIndex()
    back.load_sections(sections)
    assert stream_id == "1700000000000-3"
    assert back.blocks_per_worker() == {("a", "i1"): 3, ("b", "x"): 2} and back.gpu == idx.gpu
    for bad in (raw[:-3], b"junk" + raw, raw + b"\0"):
        with pytest.raises(WireError):
            decode_snapshot(bad)


BAD_EVENTS = [
    {"v": b"2", "w": b"a", "i": b"i", "k": b"stored", "t": b"gpu", "p": b"\0" * 8, "h": b""},
    {"v": b"1", "w": b"a", "i": b"i", "k": b"evicted", "t": b"gpu", "p": b"\0" * 8, "h": b""},
    {"v": b"1", "w": b"a", "i": b"i", "k": b"stored", "t": b"gpu", "p": b"\0" * 8, "h": b"123"},
    {"v": b"1", "w": b"a b", "i": b"i", "k": b"stored", "t": b"gpu", "p": b"\0" * 8, "h": b""},
    {"v": b"1", "w": b"a", "k": b"stored", "t": b"gpu", "p": b"\0" * 8, "h": b""},
    {"v": b"1", "w": b"\xff", "i": b"i", "k": b"stored", "t": b"gpu", "p": b"\0" * 8, "h": b""},
]


@pytest.mark.parametrize("fields", BAD_EVENTS)
def test_malformed_events_are_refused(fields):
    with pytest.raises(WireError):
        KVEventRecord.decode(fields)


def test_event_and_registry_and_load_round_trips():
    r = rec("w-1", "stored", [5, 1 << 63])
    back = KVEventRecord.decode(r.encode())
    assert back.hashes.tolist() == [5, 1 << 63] and back.kind == "stored" and back.worker == "w-1"
    entry = RegistryEntry("w-1", "abc", "decode", "m", "10.0.0.1:50051", "http://10.0.0.1:9100", 16, 1000)
    assert RegistryEntry.decode(entry.encode()) == entry
    for bad in (b"{", b'{"v": 1}', entry.encode().replace(b"decode", b"boss"),
                entry.encode().replace(b"10.0.0.1:50051", b"http://evil/x")):
        with pytest.raises(WireError):
            RegistryEntry.decode(bad)
    assert decode_load(encode_load("gw", {"w-1": [1, 2, 3]})) == ("gw", {"w-1": (1, 2, 3)})
    with pytest.raises(WireError):
        decode_load(b'{"v": 1, "router": "gw", "load": {"w": [1, -2, 3]}}')


class Source:
    def __init__(self, index: KVIndex, live: dict[str, str], usable: bool = True) -> None:
        self.index, self._live, self.usable = index, live, usable

    def instances(self) -> dict[str, str]:
        return self._live


class View:
    def __init__(self, *workers: WorkerLoad) -> None:
        self.workers = workers

    def candidates(self, role: str) -> list[WorkerLoad]:
        return [w for w in self.workers if w.serves(role) and w.available]


def features(n_tokens: int, session: str | None = None) -> RequestFeatures:
    return RequestFeatures(list(range(n_tokens)), 16, "m", session)


def test_kv_aware_prefers_cached_prefix_until_load_outweighs_it():
    req = features(640)  # 40 blocks
    idx = KVIndex()
    idx.apply(rec("b", "stored", req.block_hashes[:30]))
    src = Source(idx, {"a": "i1", "b": "i1"})
    a, b = WorkerLoad("a", "a:1", "both"), WorkerLoad("b", "b:1", "both")
    policy = KVAware(src, threshold=512)
    d = policy.route(req, View(a, b))
    assert (d.decode.name, d.reason, d.cached_tokens, d.prefill) == ("b", "kv_overlap", 480, None)
    b.decoding_blocks = 200  # b is busy: 30 cached blocks (x4) no longer pay for 200 blocks decoding there
    assert policy.route(req, View(a, b)).decode.name == "a"


def test_kv_aware_names_a_prefill_worker_only_for_a_long_uncached_part():
    idx = KVIndex()
    src = Source(idx, {"d": "i1", "p1": "i1", "p2": "i1"})
    d, p1, p2 = WorkerLoad("d", "d:1", "decode"), WorkerLoad("p1", "p:1", "prefill"), WorkerLoad("p2", "p:2", "prefill")
    policy = KVAware(src, threshold=512)
    long_req = features(1024)
    idx.apply(rec("p2", "stored", long_req.block_hashes[:20]))
    decision = policy.route(long_req, View(d, p1, p2))
    assert decision.prefill.name == "p2"  # its own cached overlap
    idx.apply(rec("d", "stored", long_req.block_hashes[:40]))  # the decode worker now holds most of it
    assert policy.route(long_req, View(d, p1, p2)).prefill is None
    assert policy.route(features(100), View(d, p1, p2)).prefill is None


def test_kv_aware_sessions_stick_and_degraded_mode_routes_by_load():
    ws = [WorkerLoad(n, f"{n}:1", "both") for n in ("a", "b", "c")]
    policy = KVAware(Source(KVIndex(), {}), threshold=512)
    picks = {policy.route(features(64, "user-7"), View(*ws)).decode.name for _ in range(20)}
    assert len(picks) == 1
    sticky = ws[[w.name for w in ws].index(picks.pop())]
    sticky.decoding_blocks = 10_000  # overloaded: the session moves
    assert policy.route(features(64, "user-7"), View(*ws)).decode is not sticky
    stale = KVAware(Source(KVIndex(), {}, usable=False), threshold=512)
    assert stale.route(features(64), View(*ws)).reason == "degraded"
