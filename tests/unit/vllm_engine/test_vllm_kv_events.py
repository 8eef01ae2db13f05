"""vLLM's ZMQ KV events → our chained block hashes, on payloads recorded from a real vLLM server
(tests/data/vllm_kv_events/recorded.json, written by record.py beside it). Needs neither vLLM nor a server."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.common.hashing import hash_token_blocks
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from splitserve.common.redis_wire import Keys
from splitserve.vllm_engine.kv_events import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventError,
    VllmKVEventBridge,
    decode_batch,
    decode_frames,
)

FIXTURE = json.loads((Path(__file__).resolve().parents[2] / "data" / "vllm_kv_events" / "recorded.json").read_text())
FRAMES = [[base64.b64decode(part) for part in frame] for frame in FIXTURE["frames"]]
REQUESTS = {r["name"]: r for r in FIXTURE["requests"]}
TOPIC = "kv-events"
SALT = "smollm2"
BS = FIXTURE["block_size"]


def bridge() -> VllmKVEventBridge:
    return VllmKVEventBridge(salt=SALT, block_size=BS, topic=TOPIC, data_parallel_rank=0)


def feed_all(b: VllmKVEventBridge, frames=FRAMES) -> list:
    return [e for frame in frames for e in b.feed(frame)]


def prompt_hashes(name: str) -> list[int]:
    return hash_token_blocks(REQUESTS[name]["prompt_token_ids"], BS, SALT)


def test_fixture_decodes_field_by_field():
    assert FIXTURE["vllm_version"] == "0.32.0" and BS == 32
    batches = [decode_frames(f, TOPIC) for f in FRAMES]
    assert [b.seq for b in batches] == list(range(len(batches)))  # one publisher, nothing lost
    assert all(b.data_parallel_rank == 0 and b.ts > 1.7e9 for b in batches)
    events = [e for b in batches for e in b.events]
    stored = [e for e in events if isinstance(e, VllmBlockStored)]
    assert stored and any(isinstance(e, VllmBlockRemoved) for e in events)
    # /reset_prefix_cache: its AllBlocksCleared goes out with the next step's events, before that step's blocks
    clear = next(i for i, e in enumerate(events) if isinstance(e, VllmAllBlocksCleared))
    assert [type(e) for e in events[clear + 1 :]] == [VllmBlockStored]
    for e in stored:
        assert len(e.token_ids) == len(e.block_hashes) * e.block_size == len(e.block_hashes) * BS
        assert e.medium == "GPU" and e.lora_id is None and e.group_idx == 0
        assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in e.block_hashes)  # int hashes, the default
    # the first stored event is the first request's prompt, as vLLM saw it
    assert stored[0].parent_block_hash is None
    assert list(stored[0].token_ids) == REQUESTS["first"]["prompt_token_ids"][: len(stored[0].token_ids)]


def test_stored_blocks_get_our_hash_of_the_prompt():
    b = bridge()
    ours = feed_all(b)
    stored = {h for e in ours if isinstance(e, BlockStored) for h in e.block_hashes}
    for name in ("first", "shared_prefix_a", "shared_prefix_b", "evict_1", "evict_2", "evict_3"):
        assert set(prompt_hashes(name)) <= stored, name
    # blocks filled by decoding: every token but the last sampled one has its KV written
    r = REQUESTS["decode_fills_blocks"]
    assert r["output_token_ids"], "the recording lost the generated token ids"
    tokens = r["prompt_token_ids"] + r["output_token_ids"][:-1]
    assert set(hash_token_blocks(tokens, BS, SALT)) <= stored
    assert b.stats.unknown_parents == 0 and b.stats.skipped == 0 and b.stats.gaps == 0


def test_shared_prefix_chains_from_our_parent():
    a, c = prompt_hashes("shared_prefix_a"), prompt_hashes("shared_prefix_b")
    assert a[:2] == c[:2] and a[2] != c[2]
    ours = feed_all(bridge())
    # vLLM stores only the second prompt's own blocks, naming the shared block as their parent
    tail = next(e for e in ours if isinstance(e, BlockStored) and e.block_hashes[0] == c[2])
    assert tail.parent_block_hash == c[1] and tail.block_hashes == c[2:]
    assert tail.token_ids == REQUESTS["shared_prefix_b"]["prompt_token_ids"][2 * BS : len(c) * BS]


def test_removals_are_mapped_and_the_reset_clears():
    b = bridge()
    ours = feed_all(b)
    held: set[int] = set()
    removed = 0
    for e in ours:
        if isinstance(e, BlockStored):
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= held  # every removal names a block we were told of
            held.difference_update(e.block_hashes)
            removed += len(e.block_hashes)
        else:
            held.clear()
    assert removed > 0 and b.stats.removed == removed and b.stats.unknown_removals == 0
    # the first request's blocks were evicted by the later long prompts
    gone = set(prompt_hashes("first"))
    assert gone <= {h for e in ours if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert isinstance(ours[-2], AllBlocksCleared) and b.stats.cleared == 1
    assert ours[-1].block_hashes == prompt_hashes("after_reset") and len(b) == 1  # all vLLM holds after the reset


def test_mirror_before_the_reset_is_what_vllm_holds():
    """The bridge's output goes to the existing publisher unchanged; its mirror is vLLM's cache in our hashes."""
    b = bridge()
    pub = KVEventPublisher(lambda: None, Keys(SALT), "w0", "i0")
    last = max(i for i, f in enumerate(FRAMES) if any(isinstance(e, VllmAllBlocksCleared)
                                                     for e in decode_frames(f, TOPIC).events))
    for frame in FRAMES[:last]:
        for e in b.feed(frame):
            pub.listener(e)
    records = pub._take()
    assert [r.kind for r in records[:1]] == ["cleared"]
    published = {int(h) for r in records[1:] for h in r.hashes}
    assert published == set(b._ours.values()) and len(published) == len(b) > 0
    assert set(prompt_hashes("evict_3")) <= published  # the last long prompt is still cached


def test_unknown_parent_is_counted_not_fatal():
    b = bridge()
    child = next(i for i, f in enumerate(FRAMES) if any(
        isinstance(e, VllmBlockStored) and e.parent_block_hash is not None for e in decode_frames(f, TOPIC).events))
    out = b.feed(FRAMES[child])  # joined late: the parent was stored before we listened
    assert b.stats.unknown_parents > 0
    assert all(not (isinstance(e, BlockStored) and e.parent_block_hash is not None) for e in out)


def test_sequence_gap_resyncs():
    b = bridge()
    b.feed(FRAMES[0])
    assert len(b) > 0
    out = b.feed(FRAMES[2])  # seq 1 lost
    assert isinstance(out[0], AllBlocksCleared) and b.stats.gaps == 1
    b2 = bridge()
    feed_all(b2, FRAMES[:3])
    out = b2.feed(FRAMES[0])  # vLLM restarted: its sequence begins again
    assert isinstance(out[0], AllBlocksCleared) and b2.stats.gaps == 1


def _payload(i: int = 0) -> list:
    return msgpack.unpackb(FRAMES[i][2], raw=False)


def _first_stored() -> tuple[int, int]:
    for i in range(len(FRAMES)):
        for j, e in enumerate(_payload(i)[1]):
            if e["type"] == "BlockStored":
                return i, j
    raise AssertionError("no BlockStored in the fixture")


def _with_event(change) -> list[bytes]:
    i, j = _first_stored()
    batch = _payload(i)
    change(batch[1][j])
    return [FRAMES[i][0], FRAMES[i][1], msgpack.packb(batch)]


@pytest.mark.parametrize("change, message", [
    (lambda e: e.update(token_ids=e["token_ids"][:-1]), "token_ids for"),
    (lambda e: e.update(surprise=1), "unknown field 'surprise'"),
    (lambda e: e.pop("block_size"), "missing field 'block_size'"),
    (lambda e: e.update(type="BlockMoved"), "unknown type 'BlockMoved'"),
    (lambda e: e.update(block_size=True), "block_size True"),
    (lambda e: e.update(block_hashes=["a hash"]), "block_hashes"),
    (lambda e: e.update(block_hashes=[b"x" * 65]), "block_hashes"),
    (lambda e: e.update(block_hashes=[]), "non-empty"),
    (lambda e: e.update(parent_block_hash=-1), "parent_block_hash"),
    (lambda e: e.update(token_ids=[-1] * len(e["token_ids"])), "token_ids must be"),
    (lambda e: e.update(medium=7), "medium"),
    (lambda e: e.update(extra_keys=[]), "extra_keys"),
])
def test_malformed_events_are_rejected_naming_the_field(change, message):
    b = bridge()
    with pytest.raises(VllmEventError, match=message):
        b.feed(_with_event(change))
    assert len(b) == 0 and b.stats.batches == 0  # nothing applied


@pytest.mark.parametrize("frames, message", [
    (lambda f: f[:2], "expected 3 parts"),
    (lambda f: [b"other", *f[1:]], "topic"),
    (lambda f: [f[0], f[1][:7], f[2]], "seq is 7 bytes"),
    (lambda f: [f[0], (-1).to_bytes(8, "big", signed=True), b""], "end marker"),
    (lambda f: [f[0], f[1], f[2] + b"\x00"], "not msgpack"),
    (lambda f: [f[0], f[1], msgpack.packb({"ts": 1})], "expected \\[ts, events"),
    (lambda f: [f[0], f[1], msgpack.packb([float("nan"), []])], "ts nan"),
    (lambda f: [f[0], f[1], msgpack.packb([1.0, [], -1])], "data_parallel_rank"),
    (lambda f: [f[0], f[1], msgpack.packb([1.0, {}])], "events is dict"),
    (lambda f: [f[0], f[1], msgpack.packb([1.0, [msgpack.ExtType(1, b"x")]])], "extension type"),
    (lambda f: [f[0], f[1], msgpack.packb([1.0, [[1, 2]]])], "expected a map"),
])
def test_malformed_frames_are_rejected(frames, message):
    with pytest.raises(VllmEventError, match=message):
        bridge().feed(frames(FRAMES[0]))


def test_another_rank_is_rejected():
    with pytest.raises(VllmEventError, match="data_parallel_rank 0, expected 1"):
        VllmKVEventBridge(SALT, BS, topic=TOPIC, data_parallel_rank=1).feed(FRAMES[0])


def test_blocks_we_cannot_name_are_skipped_and_counted():
    b = bridge()
    out = b.feed(_with_event(lambda e: e.update(lora_name="adapter", lora_id=1)))
    assert not any(isinstance(e, BlockStored) for e in out) and b.stats.skip_reasons == {"lora": b.stats.skipped}
    b = bridge()
    b.feed(_with_event(lambda e: e.update(medium="CPU")))  # an offloaded copy, not the engine's own memory
    assert b.stats.skip_reasons == {"medium": b.stats.skipped} and len(b) == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_payloads_never_escape_as_other_errors(raw):
    try:
        decode_batch(raw)
    except VllmEventError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_corrupted_recorded_payloads(data):
    frame = FRAMES[data.draw(st.integers(0, len(FRAMES) - 1))]
    payload = bytearray(frame[2])
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    b = bridge()
    try:
        b.feed([frame[0], frame[1], bytes(payload)])
    except VllmEventError:
        assert b.stats.batches == 0


_values = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
                       | st.text(max_size=8) | st.binary(max_size=40),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                   max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "x"]),
       st.dictionaries(st.sampled_from(["block_hashes", "parent_block_hash", "token_ids", "block_size", "medium",
                                        "lora_id", "extra_keys", "group_idx", "other"]), _values, max_size=6))
def test_fuzz_event_shapes(kind, fields):
    payload = msgpack.packb([1.0, [{"type": kind, **fields}], 0])
    try:
        decode_batch(payload)
    except VllmEventError:
        pass
