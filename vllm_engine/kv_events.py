"""vLLM's KV cache events, read off its ZMQ publisher and turned into ours: the wire format of vLLM's
`ZmqEventPublisher` (decoded and validated here, field by field, from msgpack; never a pickle) and the bridge that
re-hashes the blocks vLLM reports with our chained block hashes, so the existing Redis publisher and the gateways'
index take them unchanged.

A frame is three parts: the topic, an 8-byte big-endian sequence number, and a msgpack `EventBatch`
(`[ts, events, data_parallel_rank]`; each event a map tagged by `type`: `BlockStored`, `BlockRemoved`,
`AllBlocksCleared`). vLLM's block hashes (sha256 of a pickle or CBOR, its default seed, its extra keys) are
opaque here: `BlockStored` carries its blocks' token ids, from which we compute ours, and a map from vLLM's hash
to ours translates removals and parents. No vLLM import: the sidecar runs this beside a vLLM server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack

from splitserve.common.hashing import hash_token_blocks
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

VllmHash = int | bytes  # an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default) or the digest bytes
_MAX_TOKEN_ID = 1 << 31
_MAX_BLOCK_SIZE = 1 << 16
_MAX_HASH_BYTES = 64
_MAX_TEXT = 1024
_MAX_PAYLOAD = 64 << 20  # bytes: one step's events, far above what any step emits

# Every field vLLM 0.26-0.32 writes, per event type; optional ones may be absent (msgspec's omit_defaults).
_STORED_REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size")
_STORED_OPTIONAL = ("lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id")
_REMOVED_REQUIRED = ("block_hashes",)
_REMOVED_OPTIONAL = ("medium", "group_idx", "locality", "ownership")


class VllmEventError(ValueError):
    """A vLLM KV event frame that does not validate; the message names the field."""


# -- vLLM's records, as decoded ------------------------------------------------------------------------------
@dataclass(frozen=True)
class VllmBlockStored:
    block_hashes: tuple[VllmHash, ...]
    parent_block_hash: VllmHash | None
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None  # "GPU" for the engine's own KV memory (also on a CPU build), "CPU"/... offloaded
    extra_keys: tuple | None = None  # per block: multimodal ids, cache salt, ... (None: none)
    group_idx: int | None = None  # KV cache group (hybrid models have several)


@dataclass(frozen=True)
class VllmBlockRemoved:
    block_hashes: tuple[VllmHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class VllmAllBlocksCleared:
    pass


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


@dataclass(frozen=True)
class VllmEventBatch:
    seq: int
    ts: float  # seconds since the epoch, vLLM's clock
    events: tuple[VllmEvent, ...]
    data_parallel_rank: int | None


# -- decoding ------------------------------------------------------------------------------------------------
def decode_frames(frames: list[bytes] | tuple[bytes, ...], topic: str = "") -> VllmEventBatch:
    """One multipart message of vLLM's PUB socket (or of its replay socket, without the client id) → a batch."""
    if not isinstance(frames, list | tuple) or len(frames) != 3:
        raise VllmEventError(f"frame: expected 3 parts (topic, seq, payload), got {_count(frames)}")
    raw_topic, raw_seq, payload = frames
    if not all(isinstance(f, bytes | bytearray | memoryview) for f in frames):
        raise VllmEventError("frame: parts must be bytes")
    if bytes(raw_topic) != topic.encode():
        raise VllmEventError(f"frame: topic {bytes(raw_topic)[:64]!r}, expected {topic!r}")
    if len(raw_seq) != 8:
        raise VllmEventError(f"frame: seq is {len(raw_seq)} bytes, expected 8")
    seq = int.from_bytes(bytes(raw_seq), "big", signed=True)
    if seq < 0:
        raise VllmEventError(f"frame: seq {seq} (the replay socket's end marker is not a batch)")
    ts, events, rank = decode_batch(bytes(payload))
    return VllmEventBatch(seq, ts, events, rank)


def decode_batch(payload: bytes) -> tuple[float, tuple[VllmEvent, ...], int | None]:
    """A msgpack `EventBatch` → (ts, events, data_parallel_rank)."""
    if len(payload) > _MAX_PAYLOAD:
        raise VllmEventError(f"batch: payload of {len(payload)} bytes")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True, ext_hook=_no_ext)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # FormatError, ExtraData, StackError, UTF-8
        raise VllmEventError(f"batch: not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        raise VllmEventError(f"batch: expected [ts, events, data_parallel_rank], got {_kind(obj)}")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise VllmEventError(f"batch: ts {ts!r}")
    if not isinstance(events, list):
        raise VllmEventError(f"batch: events is {_kind(events)}, expected a list")
    if rank is not None and not _is_int(rank, 0, 1 << 16):
        raise VllmEventError(f"batch: data_parallel_rank {rank!r}")
    return float(ts), tuple(_decode_event(e, i) for i, e in enumerate(events)), rank


def _decode_event(e, i: int) -> VllmEvent:
    where = f"event {i}"
    if not isinstance(e, dict):
        raise VllmEventError(f"{where}: expected a map, got {_kind(e)}")
    kind = e.get("type")
    if kind == "BlockStored":
        f = _fields(e, where, _STORED_REQUIRED, _STORED_OPTIONAL)
        hashes = _hashes(f["block_hashes"], f"{where} (BlockStored) block_hashes")
        parent = f["parent_block_hash"]
        if parent is not None:
            parent = _hash(parent, f"{where} (BlockStored) parent_block_hash")
        block_size = f["block_size"]
        if not _is_int(block_size, 1, _MAX_BLOCK_SIZE):
            raise VllmEventError(f"{where} (BlockStored): block_size {block_size!r}")
        tokens = f["token_ids"]
        if not isinstance(tokens, list) or not all(_is_int(t, 0, _MAX_TOKEN_ID) for t in tokens):
            raise VllmEventError(f"{where} (BlockStored): token_ids must be a list of token ids")
        if len(tokens) != len(hashes) * block_size:
            raise VllmEventError(f"{where} (BlockStored): {len(tokens)} token_ids for {len(hashes)} blocks "
                                 f"of {block_size}")
        extra = f.get("extra_keys")
        if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)
                                  or not all(k is None or isinstance(k, list) for k in extra)):
            raise VllmEventError(f"{where} (BlockStored): extra_keys must be a list of one entry per block")
        for name in ("lora_id", "group_idx", "kv_cache_spec_sliding_window"):
            if f.get(name) is not None and not _is_int(f[name], 0, 1 << 63):
                raise VllmEventError(f"{where} (BlockStored): {name} {f[name]!r}")
        for name in ("medium", "lora_name", "kv_cache_spec_kind", "locality", "ownership", "session_id"):
            _text(f.get(name), f"{where} (BlockStored) {name}")
        return VllmBlockStored(hashes, parent, tuple(tokens), block_size, f.get("lora_id"), f.get("lora_name"),
                               f.get("medium"), None if extra is None else tuple(
                                   None if k is None else tuple(map(_freeze, k)) for k in extra),
                               f.get("group_idx"))
    if kind == "BlockRemoved":
        f = _fields(e, where, _REMOVED_REQUIRED, _REMOVED_OPTIONAL)
        hashes = _hashes(f["block_hashes"], f"{where} (BlockRemoved) block_hashes")
        if f.get("group_idx") is not None and not _is_int(f["group_idx"], 0, 1 << 63):
            raise VllmEventError(f"{where} (BlockRemoved): group_idx {f['group_idx']!r}")
        for name in ("medium", "locality", "ownership"):
            _text(f.get(name), f"{where} (BlockRemoved) {name}")
        return VllmBlockRemoved(hashes, f.get("medium"), f.get("group_idx"))
    if kind == "AllBlocksCleared":
        _fields(e, where, (), ())
        return VllmAllBlocksCleared()
    raise VllmEventError(f"{where}: unknown type {kind!r}")


def _fields(e: dict, where: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    unknown = set(e) - {"type", *required, *optional}
    if unknown:
        raise VllmEventError(f"{where} ({e['type']}): unknown field {sorted(unknown)[0]!r}")
    missing = [k for k in required if k not in e]
    if missing:
        raise VllmEventError(f"{where} ({e['type']}): missing field {missing[0]!r}")
    return e


def _hashes(v, what: str) -> tuple[VllmHash, ...]:
    if not isinstance(v, list) or not v:
        raise VllmEventError(f"{what}: expected a non-empty list")
    return tuple(_hash(h, what) for h in v)


def _hash(h, what: str) -> VllmHash:
    if _is_int(h, 0, 1 << 64) or (isinstance(h, bytes) and 0 < len(h) <= _MAX_HASH_BYTES):
        return h
    raise VllmEventError(f"{what}: {h!r:.80} is not a block hash (a uint64 or up to {_MAX_HASH_BYTES} bytes)")


def _text(v, what: str) -> None:
    if v is not None and (not isinstance(v, str) or len(v) > _MAX_TEXT):
        raise VllmEventError(f"{what}: {v!r:.80}")


def _is_int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


def _freeze(v):
    return tuple(map(_freeze, v)) if isinstance(v, list) else v


def _no_ext(code: int, data: bytes):
    raise VllmEventError(f"batch: msgpack extension type {code}")


def _kind(v) -> str:
    return type(v).__name__


def _count(v) -> str:
    return str(len(v)) if isinstance(v, list | tuple) else _kind(v)


# -- the bridge ----------------------------------------------------------------------------------------------
@dataclass
class BridgeStats:
    """What the bridge did, for a worker's metrics (counts of blocks unless said otherwise)."""

    batches: int = 0
    stored: int = 0  # blocks mapped to our hashes and passed on
    removed: int = 0
    cleared: int = 0  # AllBlocksCleared events passed on (vLLM's own, and our resyncs)
    unknown_parents: int = 0  # blocks dropped: their parent was never seen (joined late, or lost events)
    unknown_removals: int = 0  # removals of blocks never seen stored (or dropped above)
    skipped: int = 0  # blocks we cannot name with our hash: LoRA, extra keys, another medium, group or block size
    gaps: int = 0  # resyncs for a lost or restarted stream (sequence numbers not consecutive)
    skip_reasons: dict[str, int] = field(default_factory=dict)


class VllmKVEventBridge:
    """One vLLM publisher (one data-parallel rank) → our `KVCacheEvent`s, in order.

    `feed` takes each multipart message and returns our events for it; hand them to a `KVEventPublisher`'s
    listener. A block's hash is ours (`hash_token_blocks` salted by the served model name, chained from the
    parent), so a vLLM worker's blocks and a native worker's blocks of the same prompt have the same hash. A
    sequence gap, a restart (the sequence going back) or vLLM's own `AllBlocksCleared` clears the map and
    passes on an `AllBlocksCleared`: the index forgets this worker's blocks rather than keep stale ones.
    """

    def __init__(self, salt: str, block_size: int, topic: str = "", medium: str = "GPU",
                 data_parallel_rank: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: {block_size} is not positive")
        self.salt = salt  # the served model name, as the engine's and the router's hashes use it
        self.block_size = block_size
        self.topic = topic
        self.medium = medium  # the medium of the engine's own KV memory; other mediums are skipped
        self.data_parallel_rank = data_parallel_rank
        self.stats = BridgeStats()
        self._ours: dict[VllmHash, int] = {}  # vLLM's hash -> ours, for every block vLLM holds (as told)
        self._last_seq: int | None = None

    def __len__(self) -> int:
        return len(self._ours)

    def feed(self, frames: list[bytes] | tuple[bytes, ...]) -> list[KVCacheEvent]:
        """One multipart message → our events (raises `VllmEventError` and changes nothing if it is malformed)."""
        batch = decode_frames(frames, self.topic)
        if self.data_parallel_rank is not None and batch.data_parallel_rank not in (None, self.data_parallel_rank):
            raise VllmEventError(f"batch: data_parallel_rank {batch.data_parallel_rank}, expected "
                                 f"{self.data_parallel_rank}")
        return self.apply(batch)

    def apply(self, batch: VllmEventBatch) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        if self._last_seq is not None and batch.seq != self._last_seq + 1:
            self.stats.gaps += 1
            out.append(self._clear())
        self._last_seq = batch.seq
        self.stats.batches += 1
        for event in batch.events:
            if isinstance(event, VllmBlockStored):
                mapped = self._stored(event)
                if mapped is not None:
                    out.append(mapped)
            elif isinstance(event, VllmBlockRemoved):
                mapped = self._removed(event)
                if mapped is not None:
                    out.append(mapped)
            else:
                out.append(self._clear())
        return out

    def reset(self) -> None:
        """Forget everything, as if the stream began again (the next batch is not a gap)."""
        self._ours.clear()
        self._last_seq = None

    def _clear(self) -> AllBlocksCleared:
        self._ours.clear()
        self.stats.cleared += 1
        return AllBlocksCleared()

    def _skip(self, reason: str, n: int) -> None:
        self.stats.skipped += n
        self.stats.skip_reasons[reason] = self.stats.skip_reasons.get(reason, 0) + n

    def _stored(self, e: VllmBlockStored) -> BlockStored | None:
        n = len(e.block_hashes)
        if e.medium not in (None, self.medium):
            self._skip("medium", n)
            return None
        if e.group_idx not in (None, 0):
            self._skip("group", n)
            return None
        if e.lora_id is not None or e.lora_name is not None:
            self._skip("lora", n)
            return None
        if e.extra_keys is not None and any(k for k in e.extra_keys):
            self._skip("extra_keys", n)
            return None
        if e.block_size != self.block_size:
            self._skip("block_size", n)
            return None
        if e.parent_block_hash is None:
            parent = None
        elif e.parent_block_hash in self._ours:
            parent = self._ours[e.parent_block_hash]
        else:
            self.stats.unknown_parents += n
            return None
        ours = hash_token_blocks(e.token_ids, e.block_size, self.salt, parent_hash=parent)
        for theirs, mine in zip(e.block_hashes, ours, strict=True):
            self._ours[theirs] = mine
        self.stats.stored += n
        return BlockStored(ours, parent, list(e.token_ids), e.block_size)

    def _removed(self, e: VllmBlockRemoved) -> BlockRemoved | None:
        if e.medium not in (None, self.medium) or e.group_idx not in (None, 0):
            return None  # never mapped (skipped when stored)
        ours = []
        for theirs in e.block_hashes:
            mine = self._ours.pop(theirs, None)
            if mine is None:
                self.stats.unknown_removals += 1
            else:
                ours.append(mine)
        if not ours:
            return None
        self.stats.removed += len(ours)
        return BlockRemoved(ours)
