"""Every Redis key name and record splitserve writes, in one place, with a version and its validation.

Keys of one served model share the hash tag `{ss:<model>}`, so a model's registry, event stream, snapshot and
load reports live in one Redis Cluster slot (multi-key reads stay atomic); KV pool blocks have no tag and spread
over all slots. Leases are scores in a sorted set on the Redis server's clock, not key TTLs: the only keys with a
TTL are KV pool blocks, so a Redis that evicts `volatile-lru` under memory pressure evicts pool blocks and never
the registry. Records are JSON (registry, load reports) or compact binary (events, snapshots): never pickles.
A record that does not validate raises `WireError` naming what is wrong; readers count and skip it.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass

import numpy as np

VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,252}$")
_ENDPOINT = re.compile(r"^[A-Za-z0-9._-]+(?::[0-9]{1,5})$|^\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}$")
MAX_HASHES_PER_EVENT = 1 << 16
TIERS = ("gpu", "pool")  # where a block lives: a worker's own KV memory, or the shared KV pool
KINDS = ("stored", "removed", "cleared")


class WireError(ValueError):
    """A Redis record that does not validate."""


class Keys:
    """Key names for one served model."""

    def __init__(self, model: str) -> None:
        if not model or any(c in model for c in "{}\n"):
            raise ValueError(f"model name {model!r} cannot be used in a Redis key")
        self.tag = f"{{ss:{model}}}"
        p = f"ss:v{VERSION}:{self.tag}"
        self.workers = f"{p}:workers"  # sorted set: worker name -> lease expiry (ms, Redis server clock)
        self.events = f"{p}:kv-events"  # stream of KV block events
        self.snapshot = f"{p}:kv-snapshot"  # the index as of some stream id (binary)
        self.snapshot_lock = f"{p}:kv-snapshot-lock"  # who writes the next snapshot (SET NX PX)
        self.routers = f"{p}:routers"  # sorted set: gateway id -> report expiry (ms, Redis server clock)
        self._prefix = p

    def worker(self, name: str) -> str:
        """A worker's registry entry (JSON; its lease is its score in `workers`)."""
        return f"{self._prefix}:worker:{name}"

    def router(self, router_id: str) -> str:
        """A gateway's in-flight load report (JSON; it expires with its score in `routers`)."""
        return f"{self._prefix}:router:{router_id}"

    def session(self, key: str) -> str:
        return f"{self._prefix}:session:{key}"

    def pool_stats(self, worker: str) -> str:
        """A vLLM worker's KV pool counters (hash: field -> total), written by its connector inside vLLM and
        mirrored on the worker's /metrics. No TTL: eviction never takes it."""
        return f"{self._prefix}:pool-stats:{worker}"


def check_name(name: str, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise WireError(f"{what}: {name!r} is not a valid name")
    return name


# -- the registry ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegistryEntry:
    name: str
    instance_id: str
    role: str  # prefill | decode | both
    model: str
    endpoint: str  # host:port (gRPC)
    metrics_url: str
    block_size: int
    kv_capacity_blocks: int
    draining: bool = False
    # load, as the worker last reported it
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    waiting_prefill_tokens: int = 0

    def encode(self) -> bytes:
        return json.dumps({"v": VERSION, **self.__dict__}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> RegistryEntry:
        try:
            d = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise WireError(f"registry entry is not JSON: {e}") from None
        if not isinstance(d, dict) or d.pop("v", None) != VERSION:
            raise WireError("registry entry: unknown version")
        try:
            entry = cls(**d)
        except TypeError as e:
            raise WireError(f"registry entry: {e}") from None
        check_name(entry.name, "registry entry name")
        check_name(entry.instance_id, "registry entry instance_id")
        if entry.role not in ("prefill", "decode", "both"):
            raise WireError(f"registry entry: role {entry.role!r}")
        if not isinstance(entry.endpoint, str) or not _ENDPOINT.match(entry.endpoint):
            raise WireError(f"registry entry: endpoint {entry.endpoint!r} is not host:port")
        port = int(entry.endpoint.rsplit(":", 1)[1])
        if not 0 < port < 65536:
            raise WireError(f"registry entry: port {port}")
        for f in ("block_size", "kv_capacity_blocks", "num_waiting", "num_running", "kv_blocks_used",
                  "waiting_prefill_tokens"):
            v = getattr(entry, f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 40:
                raise WireError(f"registry entry: {f} {v!r}")
        if not isinstance(entry.draining, bool) or not isinstance(entry.model, str) \
                or not isinstance(entry.metrics_url, str) or len(entry.metrics_url) > 512:
            raise WireError("registry entry: bad field type")
        return entry


# -- KV events ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVEventRecord:
    """One batch of a worker's block events of one kind and tier (a stream entry)."""

    worker: str
    instance_id: str
    kind: str  # stored | removed | cleared
    tier: str  # gpu | pool
    hashes: np.ndarray  # uint64, chained block hashes (stored: in prefix order)
    parent: int = 0  # stored: the parent of hashes[0] (0: none)

    def encode(self) -> dict[str, bytes]:
        return {"v": str(VERSION).encode(), "w": self.worker.encode(), "i": self.instance_id.encode(),
                "k": self.kind.encode(), "t": self.tier.encode(), "p": struct.pack("<Q", self.parent),
                "h": np.ascontiguousarray(self.hashes, dtype="<u8").tobytes()}

    @classmethod
    def decode(cls, fields: dict) -> KVEventRecord:
        try:
            f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
            if f.get("v") not in (b"1", "1"):
                raise WireError(f"event: unknown version {f.get('v')!r}")
            kind, tier = _text(f["k"]), _text(f["t"])
            if kind not in KINDS or tier not in TIERS:
                raise WireError(f"event: kind {kind!r} / tier {tier!r}")
            raw_h, raw_p = f["h"], f["p"]
            if not isinstance(raw_h, bytes) or len(raw_h) % 8 or len(raw_h) > 8 * MAX_HASHES_PER_EVENT:
                raise WireError("event: hashes are not a packed uint64 array")
            if not isinstance(raw_p, bytes) or len(raw_p) != 8:
                raise WireError("event: parent is not 8 bytes")
            worker = check_name(_text(f["w"]), "event worker")
            instance = check_name(_text(f["i"]), "event instance_id")
        except KeyError as e:
            raise WireError(f"event: missing field {e}") from None
        except UnicodeDecodeError:
            raise WireError("event: a text field is not UTF-8") from None
        return cls(worker, instance, kind, tier, np.frombuffer(raw_h, dtype="<u8"), struct.unpack("<Q", raw_p)[0])


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- index snapshots --------------------------------------------------------------------------------------
_SNAP_MAGIC = b"SSKV"
_SNAP_HEAD = struct.Struct("<4sHI")  # magic, version, number of sections
_SEC_HEAD = struct.Struct("<HHBI")  # name length, instance length, tier index, number of hashes


def encode_snapshot(stream_id: str, sections: list[tuple[str, str, str, np.ndarray]]) -> bytes:
    """The index as (worker, instance_id, tier, hashes) sections, valid as of `stream_id`."""
    out = [_SNAP_HEAD.pack(_SNAP_MAGIC, VERSION, len(sections)), struct.pack("<H", len(stream_id)),
           stream_id.encode()]
    for worker, instance, tier, hashes in sections:
        w, i = worker.encode(), instance.encode()
        out += [_SEC_HEAD.pack(len(w), len(i), TIERS.index(tier), len(hashes)), w, i,
                np.ascontiguousarray(hashes, dtype="<u8").tobytes()]
    return b"".join(out)


def decode_snapshot(raw: bytes) -> tuple[str, list[tuple[str, str, str, np.ndarray]]]:
    try:
        magic, version, n = _SNAP_HEAD.unpack_from(raw, 0)
        if magic != _SNAP_MAGIC or version != VERSION:
            raise WireError("snapshot: unknown format")
        pos = _SNAP_HEAD.size
        (slen,) = struct.unpack_from("<H", raw, pos)
        pos += 2
        stream_id = raw[pos : pos + slen].decode()
        pos += slen
        if not re.fullmatch(r"\d+-\d+", stream_id):
            raise WireError("snapshot: bad stream id")
        sections = []
        for _ in range(n):
            wl, il, tier, count = _SEC_HEAD.unpack_from(raw, pos)
            pos += _SEC_HEAD.size
            worker = check_name(raw[pos : pos + wl].decode(), "snapshot worker")
            pos += wl
            instance = check_name(raw[pos : pos + il].decode(), "snapshot instance_id")
            pos += il
            if tier >= len(TIERS) or pos + 8 * count > len(raw):
                raise WireError("snapshot: truncated or bad tier")
            sections.append((worker, instance, TIERS[tier], np.frombuffer(raw, dtype="<u8", count=count, offset=pos)))
            pos += 8 * count
        if pos != len(raw):
            raise WireError("snapshot: trailing bytes")
        return stream_id, sections
    except (struct.error, UnicodeDecodeError) as e:
        raise WireError(f"snapshot: {e}") from None


# -- gateway load reports ----------------------------------------------------------------------------------
def encode_load(router_id: str, load: dict[str, tuple[int, int, int]]) -> bytes:
    """A gateway's in-flight work per worker: (requests, blocks waiting for their prefill, blocks decoding)."""
    return json.dumps({"v": VERSION, "router": router_id, "load": load}, separators=(",", ":")).encode()


def decode_load(raw: bytes | str) -> tuple[str, dict[str, tuple[int, int, int]]]:
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"load report is not JSON: {e}") from None
    if not isinstance(d, dict) or d.get("v") != VERSION or not isinstance(d.get("load"), dict):
        raise WireError("load report: unknown version or shape")
    router = check_name(d.get("router"), "load report router")
    load = {}
    for name, v in d["load"].items():
        check_name(name, "load report worker")
        if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and 0 <= x < 1 << 40 for x in v)):
            raise WireError(f"load report: bad counts for {name}")
        load[name] = (v[0], v[1], v[2])
    return router, load


# -- KV pool blocks ----------------------------------------------------------------------------------------
_DTYPES = ("float32", "bfloat16", "float16")
_BLOCK_HEAD = struct.Struct("<4sHBBHHHHQI")  # magic, version, dtype, 0, layers, block size, kv heads, head dim,
#                                              payload bytes, crc32 of the payload
_BLOCK_MAGIC = b"SSKB"


@dataclass(frozen=True)
class PoolNamespace:
    """Where one KV layout's blocks live: blocks are shared only between workers of the same model, dtype, block
    size, KV shape and tensor-parallel shard. Keys carry no hash tag, so a Redis Cluster spreads them over slots."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    layout: str = ""  # "": the native engine's payload; "vllm-<device>": vLLM's per-layer block bytes

    def __post_init__(self) -> None:
        if self.layout and not re.fullmatch(r"[a-z0-9-]{1,32}", self.layout):
            raise ValueError(f"KV pool: layout tag {self.layout!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KV pool: unsupported dtype {self.dtype}")
        if not self.model or any(c in self.model for c in "{}\n "):
            raise ValueError(f"KV pool: model name {self.model!r} cannot be used in a key")

    @property
    def prefix(self) -> str:
        return (f"ss:pool:v{VERSION}:{self.model}:{self.dtype}:b{self.block_size}:"
                f"l{self.num_layers}h{self.num_kv_heads}d{self.head_dim}:tp{self.tp_rank}-{self.tp_size}:"
                + (f"{self.layout}:" if self.layout else ""))

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    @property
    def payload_bytes(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def encode_block(self, payload: bytes | memoryview) -> bytes:
        if len(payload) != self.payload_bytes:
            raise ValueError(f"KV pool: a block is {self.payload_bytes} bytes, got {len(payload)}")
        head = _BLOCK_HEAD.pack(_BLOCK_MAGIC, VERSION, _DTYPES.index(self.dtype), 0, self.num_layers,
                                self.block_size, self.num_kv_heads, self.head_dim, len(payload),
                                zlib.crc32(payload))
        return head + bytes(payload)

    def decode_block(self, raw: bytes) -> memoryview:
        """The payload of a stored block, after checking its header against this namespace and its checksum."""
        if not isinstance(raw, bytes | bytearray) or len(raw) < _BLOCK_HEAD.size:
            raise WireError("pool block: too short")
        magic, version, dtype, _, layers, bs, heads, dim, n, crc = _BLOCK_HEAD.unpack_from(raw, 0)
        if magic != _BLOCK_MAGIC or version != VERSION:
            raise WireError("pool block: unknown format")
        if (dtype >= len(_DTYPES) or _DTYPES[dtype] != self.dtype or (layers, bs, heads, dim) !=
                (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim) or n != self.payload_bytes
                or len(raw) != _BLOCK_HEAD.size + n):
            raise WireError("pool block: header does not match this layout")
        payload = memoryview(raw)[_BLOCK_HEAD.size :]
        if zlib.crc32(payload) != crc:
            raise ChecksumError("pool block: checksum mismatch")
        return payload


class ChecksumError(WireError):
    """A pool block whose bytes changed after it was written."""


def pool_hash_of_key(key: str | bytes) -> int | None:
    """The block hash in a pool key (for eviction notices), or None if it is not a pool key."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    if not text.startswith(f"ss:pool:v{VERSION}:"):
        return None
    tail = text.rsplit(":", 1)[-1]
    try:
        return int(tail, 16) if len(tail) == 16 else None
    except ValueError:
        return None


# -- leases --------------------------------------------------------------------------------------------------
# KEYS: the record, the lease set; ARGV: member, record, lease ms. Returns 1 if the record existed before.
LEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local existed = redis.call('EXISTS', KEYS[1])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return existed
"""


# KEYS: the lease set. Returns {now ms, {member, expiry, member, expiry, ...}} (one slot: works on a cluster).
READ_LEASES_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {now, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')}
"""
