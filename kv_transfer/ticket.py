"""Transfer tickets: what a decode worker publishes so a prefill worker can write into its reserved blocks.

Serialized as versioned JSON (never pickle) and validated field by field on receipt.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import asdict, dataclass, field

from splitserve.kv_transfer.errors import IncompatibleLayout, MalformedTicket
from splitserve.kv_transfer.layout import KVLayout

TICKET_VERSION = 1
MAX_TICKET_BYTES = 4 << 20
MAX_BLOCKS = 1 << 20
_BACKENDS = ("tcp", "nixl")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TransferTicket:
    request_id: str
    backend: str  # tcp | nixl
    agent: str  # the receiving agent's name
    num_layers: int
    block_bytes: int  # bytes of one block of K (or V) in one layer
    dtype: str
    block_ids: list[int]  # destination blocks, in prompt order (the same ids in every layer)
    skip_blocks: int = 0  # leading blocks the receiver already holds (its own prefix-cache hit)
    num_blocks: int = 0  # blocks per layer in the receiver's KV cache (every block id is below it)
    deadline: float = 0.0  # unix time by which the transfer must complete
    endpoint: str = ""  # tcp: host:port of the receiver
    nixl_metadata: bytes = b""  # nixl: the receiving agent's metadata
    regions: list[list[int]] = field(default_factory=list)  # nixl: per layer [K address, V address]
    device_id: int = 0
    mem_type: str = "DRAM"  # DRAM | VRAM
    version: int = TICKET_VERSION

    def encode(self) -> bytes:
        d = asdict(self)
        d["nixl_metadata"] = base64.b64encode(self.nixl_metadata).decode()
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
        try:
            d["nixl_metadata"] = base64.b64decode(d.get("nixl_metadata", ""), validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise MalformedTicket("nixl_metadata is not base64") from None
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
        need(isinstance(self.agent, str) and 0 < len(self.agent) <= 256, "agent: 1-256 chars")
        need(_is_int(self.num_layers) and 1 <= self.num_layers <= 4096, "num_layers: 1-4096")
        need(_is_int(self.block_bytes) and 1 <= self.block_bytes <= 1 << 30, "block_bytes: positive")
        need(self.dtype in _DTYPES, f"dtype: one of {_DTYPES}")
        need(isinstance(self.block_ids, list) and 0 < len(self.block_ids) <= MAX_BLOCKS, "block_ids: non-empty list")
        need(all(_is_int(b) and 0 <= b < 1 << 31 for b in self.block_ids), "block_ids: non-negative ints")
        need(len(set(self.block_ids)) == len(self.block_ids), "block_ids: no repeats")
        need(_is_int(self.num_blocks) and max(self.block_ids) < self.num_blocks <= 1 << 31,
             "num_blocks: above every block id")
        need(_is_int(self.skip_blocks) and 0 <= self.skip_blocks < len(self.block_ids), "skip_blocks: in range")
        need(isinstance(self.deadline, int | float) and math.isfinite(self.deadline), "deadline: a number")
        need(_is_int(self.device_id) and 0 <= self.device_id < 1024, "device_id")
        need(self.mem_type in ("DRAM", "VRAM"), "mem_type: DRAM or VRAM")
        if self.backend == "tcp":
            host, _, port = self.endpoint.rpartition(":")
            need(bool(host) and port.isdigit() and 0 < int(port) < 65536, "endpoint: host:port")
        else:
            need(0 < len(self.nixl_metadata) <= MAX_TICKET_BYTES, "nixl_metadata: non-empty")
            need(isinstance(self.regions, list) and len(self.regions) == self.num_layers
                 and all(isinstance(r, list) and len(r) == 2 and all(_is_int(a) and a > 0 for a in r)
                         for r in self.regions), "regions: [K address, V address] per layer")

    def check_compatible(self, layout: KVLayout) -> None:
        if (self.num_layers, self.block_bytes, self.dtype) != (layout.num_layers, layout.block_bytes, layout.dtype):
            raise IncompatibleLayout(
                f"ticket KV layout (layers={self.num_layers}, block_bytes={self.block_bytes}, dtype={self.dtype}) "
                f"differs from ours (layers={layout.num_layers}, block_bytes={layout.block_bytes}, dtype={layout.dtype})"
            )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
