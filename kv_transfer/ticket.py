"""Transfer tickets: what a decode worker publishes so a prefill worker can write into its reserved blocks.

Serialized as versioned JSON (never pickle) and validated field by field on receipt.

The shard layout (version 2). A decode worker runs at tensor-parallel size d = len(ranks); rank r's KV cache
holds, per layer, K and V tensors [num_blocks, block_size, ranks[r].num_heads, head_dim] of dtype, with global
KV heads ranks[r].head_start .. head_start + num_heads - 1 (`splitserve.engine.parallel.kv_head_range`: an
equal split of num_kv_heads, or with fewer heads than ranks one head shared by d / num_kv_heads consecutive
ranks). block_ids are the same on every rank. A prefill worker at size p computes the routes from num_kv_heads,
p and d (`shards.plan_routes`): each of its ranks sends only the heads it is the first holder of, to the first
decode rank holding them (that rank's `endpoint` / NIXL agent and `regions`), so each head crosses once; decode
ranks sharing a head copy it locally after it landed. The sender slices heads out of its shard and the
receiver writes them into its own, so no rank ever holds more than its shard.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field

from splitserve.engine.parallel import kv_head_range
from splitserve.kv_transfer.errors import IncompatibleLayout, MalformedTicket
from splitserve.kv_transfer.layout import KVLayout

TICKET_VERSION = 2
MAX_TICKET_BYTES = 4 << 20
MAX_BLOCKS = 1 << 20
MAX_RANKS = 64
_BACKENDS = ("tcp", "nixl")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RankEndpoint:
    """One receiving rank: where its KV shard is and which heads it holds."""

    agent: str  # its transfer agent's name
    head_start: int  # first KV head it holds (global index)
    num_heads: int
    endpoint: str = ""  # tcp: host:port of its listener
    nixl_metadata: bytes = b""  # nixl: its agent's metadata
    regions: list[list[int]] = field(default_factory=list)  # nixl: per layer [K address, V address]
    device_id: int = 0
    mem_type: str = "DRAM"  # DRAM | VRAM

    def to_json(self) -> dict:
        """Its JSON form, made once: an endpoint never changes, and every ticket of its worker carries it."""
        cached = self.__dict__.get("_json")
        if cached is None:
            cached = {f: getattr(self, f) for f in self.__dataclass_fields__}
            cached["nixl_metadata"] = base64.b64encode(self.nixl_metadata).decode()
            cached["regions"] = [list(x) for x in self.regions]
            self.__dict__["_json"] = cached
        return cached

    @classmethod
    def from_json(cls, d: object) -> RankEndpoint:
        if not isinstance(d, dict):
            raise MalformedTicket("ticket ranks: each must be an object")
        known = set(cls.__dataclass_fields__)
        if set(d) - known:
            raise MalformedTicket(f"unknown rank fields: {sorted(set(d) - known)}")
        d = dict(d)
        try:
            d["nixl_metadata"] = base64.b64decode(d.get("nixl_metadata", ""), validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise MalformedTicket("nixl_metadata is not base64") from None
        try:
            return cls(**d)
        except TypeError as e:
            raise MalformedTicket(f"rank fields: {e}") from None


@dataclass
class TransferTicket:
    request_id: str
    backend: str  # tcp | nixl
    num_layers: int
    dtype: str
    block_size: int  # tokens per block
    num_kv_heads: int  # the model's, over all ranks
    head_dim: int
    block_ids: list[int]  # destination blocks, in prompt order (the same ids in every layer and on every rank)
    ranks: list[RankEndpoint]  # the decode worker's tensor-parallel ranks, in rank order
    skip_blocks: int = 0  # leading blocks the receiver already holds (its own prefix-cache hit)
    num_blocks: int = 0  # blocks per layer in the receiver's KV cache (every block id is below it)
    deadline: float = 0.0  # unix time by which the transfer must complete
    version: int = TICKET_VERSION

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def encode(self) -> bytes:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["ranks"] = [r.to_json() for r in self.ranks]
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> TransferTicket:
        if not isinstance(data, bytes | bytearray) or len(data) > MAX_TICKET_BYTES:
            raise MalformedTicket("ticket must be at most 4 MiB of bytes")
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MalformedTicket(f"ticket is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise MalformedTicket("ticket must be a JSON object")
        if d.get("version") != TICKET_VERSION:
            raise MalformedTicket(f"unsupported ticket version {d.get('version')!r}")
        known = set(cls.__dataclass_fields__)
        if set(d) - known:
            raise MalformedTicket(f"unknown ticket fields: {sorted(set(d) - known)}")
        if not isinstance(d.get("ranks"), list):
            raise MalformedTicket("ticket field ranks: a list")
        d["ranks"] = [RankEndpoint.from_json(r) for r in d["ranks"]]
        try:
            ticket = cls(**d)
        except TypeError as e:
            raise MalformedTicket(f"ticket fields: {e}") from None
        ticket.validate()
        return ticket

    def validate(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise MalformedTicket(f"ticket field {what}")

        need(isinstance(self.request_id, str) and 0 < len(self.request_id) <= 256, "request_id: 1-256 chars")
        need(self.backend in _BACKENDS, f"backend: one of {_BACKENDS}")
        need(_is_int(self.num_layers) and 1 <= self.num_layers <= 4096, "num_layers: 1-4096")
        need(self.dtype in _DTYPES, f"dtype: one of {_DTYPES}")
        need(_is_int(self.block_size) and 1 <= self.block_size <= 1024, "block_size: 1-1024")
        need(_is_int(self.num_kv_heads) and 1 <= self.num_kv_heads <= 1024, "num_kv_heads: 1-1024")
        need(_is_int(self.head_dim) and 1 <= self.head_dim <= 4096, "head_dim: 1-4096")
        need(isinstance(self.block_ids, list) and 0 < len(self.block_ids) <= MAX_BLOCKS, "block_ids: non-empty list")
        need(all(_is_int(b) and 0 <= b < 1 << 31 for b in self.block_ids), "block_ids: non-negative ints")
        need(len(set(self.block_ids)) == len(self.block_ids), "block_ids: no repeats")
        need(_is_int(self.num_blocks) and max(self.block_ids) < self.num_blocks <= 1 << 31,
             "num_blocks: above every block id")
        need(_is_int(self.skip_blocks) and 0 <= self.skip_blocks < len(self.block_ids), "skip_blocks: in range")
        need(isinstance(self.deadline, int | float) and math.isfinite(self.deadline), "deadline: a number")
        need(isinstance(self.ranks, list) and 1 <= len(self.ranks) <= MAX_RANKS, f"ranks: 1-{MAX_RANKS}")
        for r, rank in enumerate(self.ranks):
            self._validate_rank(r, rank, need)

    def _validate_rank(self, r: int, rank: RankEndpoint, need) -> None:
        need(isinstance(rank.agent, str) and 0 < len(rank.agent) <= 256, f"ranks[{r}].agent: 1-256 chars")
        try:
            heads = kv_head_range(self.num_kv_heads, r, len(self.ranks))
        except ValueError:
            heads = None
        need(heads is not None and (rank.head_start, rank.num_heads) == (heads.start, len(heads)),
             f"ranks[{r}]: heads {rank.head_start}+{rank.num_heads} are not that rank's shard of "
             f"{self.num_kv_heads} over {len(self.ranks)} ranks")
        need(_is_int(rank.device_id) and 0 <= rank.device_id < 1024, f"ranks[{r}].device_id")
        need(rank.mem_type in ("DRAM", "VRAM"), f"ranks[{r}].mem_type: DRAM or VRAM")
        if self.backend == "tcp":
            host, _, port = rank.endpoint.rpartition(":")
            need(bool(host) and port.isdigit() and 0 < int(port) < 65536, f"ranks[{r}].endpoint: host:port")
        else:
            need(0 < len(rank.nixl_metadata) <= MAX_TICKET_BYTES, f"ranks[{r}].nixl_metadata: non-empty")
            need(isinstance(rank.regions, list) and len(rank.regions) == self.num_layers
                 and all(isinstance(x, list) and len(x) == 2 and all(_is_int(a) and a > 0 for a in x)
                         for x in rank.regions), f"ranks[{r}].regions: [K address, V address] per layer")

    def check_compatible(self, layout: KVLayout) -> None:
        """The sender's layout must be the same model's KV: layers, dtype, block size, heads and head size."""
        ours = (layout.num_layers, layout.dtype, layout.block_size, layout.shard.num_kv_heads, layout.head_dim)
        theirs = (self.num_layers, self.dtype, self.block_size, self.num_kv_heads, self.head_dim)
        if ours != theirs:
            raise IncompatibleLayout(
                f"ticket KV layout (layers, dtype, block_size, kv_heads, head_dim)={theirs} differs from ours {ours}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
