"""The layer-wise push connector's wire formats, in one place, each validated field by field off the wire (JSON,
never pickle): the connector's settings, the ticket a decode worker hands a prefill worker, the control messages
between a worker and the connectors inside its vLLM server, a decode server's NIXL metadata answer, and the NIXL
notifications a prefill server sends a decode server. Plain Python: the worker beside vLLM and the connector
inside it both import it.

Version `VERSION` of each; a peer speaking another is refused with one line.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any

VERSION = 1
EXTRA_KEY = "splitserve_layerwise"  # our settings' key in kv_connector_extra_config
PARAMS_KEY = "splitserve_layerwise"  # our part of a request's kv_transfer_params
MAX_MESSAGE = 4 << 20  # bytes of one control message or ticket
MAX_BLOCKS = 1 << 20
MAX_KEY = 200
MAX_RANKS = 64
HOST_ENV, PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"
_KEY = re.compile(r"[\x21-\x7e]{1,200}")  # printable ASCII, no space, no "|" (the notice's separator)
_HOST = re.compile(r"[A-Za-z0-9.:_\-\[\]%]{1,255}")


class WireError(ValueError):
    """A message that does not parse or does not fit (the text says which field)."""


# == settings (kv_connector_extra_config) ========================================================================
@dataclass(frozen=True)
class LayerwiseSettings:
    """What the connector needs to know that vLLM does not."""

    control: str  # the worker's control endpoint (ZMQ, loopback): tcp://127.0.0.1:PORT
    # where this server's NIXL metadata is served (a decode server's peers dial it); base port: data-parallel rank
    # d, tensor-parallel rank r serve at port + d * tp + r. Unset: VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT (a pod's
    # address is known only in its environment)
    side_channel_host: str = ""
    side_channel_port: int = 0
    layer_group: int = 1  # consecutive layers per NIXL write (1: a write per layer)
    ticket_wait_seconds: float = 30.0  # a prefill server keeps a request's blocks this long for a late ticket

    def to_extra(self) -> dict[str, Any]:
        return {EXTRA_KEY: dict(self.__dict__)}

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> LayerwiseSettings:
        raw = dict((extra or {}).get(EXTRA_KEY) or {})
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{EXTRA_KEY}: unknown setting {sorted(unknown)[0]!r}")
        if "control" not in raw:
            raise ValueError(f"{EXTRA_KEY}.control is required")
        if not raw.get("side_channel_host"):
            raw["side_channel_host"] = os.environ.get(HOST_ENV, "") or "127.0.0.1"
        if not raw.get("side_channel_port"):
            port = os.environ.get(PORT_ENV, "")
            raw["side_channel_port"] = int(port) if port.isdigit() else 5600
        s = cls(**raw)
        if not isinstance(s.control, str) or not s.control.startswith("tcp://"):
            raise ValueError(f"{EXTRA_KEY}.control: {s.control!r} is not a tcp:// endpoint")
        _host(s.side_channel_host, f"{EXTRA_KEY}.side_channel_host")
        _int(s.side_channel_port, f"{EXTRA_KEY}.side_channel_port", 1, 65535)
        _int(s.layer_group, f"{EXTRA_KEY}.layer_group", 1, 1 << 16)
        _number(s.ticket_wait_seconds, f"{EXTRA_KEY}.ticket_wait_seconds", 0.001, 86400)
        return s


def request_params(role: str, key: str, deadline: float | None = None) -> dict[str, Any]:
    """Our part of a request's kv_transfer_params: a `consumer` (a decode server's reservation, parked until its KV
    lands or `deadline`, unix seconds) or a `producer` (a prefill server's request, whose KV goes where its ticket
    says)."""
    out: dict[str, Any] = {"role": role, "key": key}
    if deadline is not None:
        out["deadline"] = deadline
    return {PARAMS_KEY: out}


def parse_request_params(params: Any) -> tuple[str, str, float] | None:
    """(role, key, deadline) from a request's kv_transfer_params, or None when the request is not ours. vLLM
    passes these through from the HTTP body; the worker beside it wrote them, but they are checked all the same."""
    if not isinstance(params, dict):
        return None
    ours = params.get(PARAMS_KEY)
    if not isinstance(ours, dict):
        return None
    role, key, deadline = ours.get("role"), ours.get("key"), ours.get("deadline", math.inf)
    if role not in ("consumer", "producer") or not isinstance(key, str) or not _KEY.fullmatch(key) \
            or not isinstance(deadline, int | float):
        raise WireError(f"kv_transfer_params.{PARAMS_KEY}: not a role, key and deadline")
    return role, key, float(deadline)


# == the ticket (decode worker -> prefill worker, opaque to the roles) ===========================================
@dataclass(frozen=True)
class LayerwiseTicket:
    """Where a prefill server writes a prompt's KV: decode server `engine`'s blocks `block_ids`, which hold the
    prompt's blocks `first_block` on (one id per block of the first `num_tokens` tokens from there); the ranks' NIXL
    metadata are served at host:port + dp * tp + rank. No write may be posted after `deadline` (unix seconds)."""

    key: str  # the decode server's name for the reservation; the notifications carry it back
    engine: str  # the decode server's vLLM engine id (its agents are named after it)
    dp_rank: int
    tp_size: int
    host: str
    port: int
    block_size: int
    first_block: int
    block_ids: tuple[int, ...]
    num_tokens: int  # the prompt's tokens (all of them: the decode server recomputes none but the last)
    deadline: float

    def to_json(self) -> dict[str, Any]:
        """Its fields as JSON values (what `from_json` reads; the control line carries this form)."""
        d = dict(self.__dict__)
        d["block_ids"] = list(self.block_ids)
        return d

    def encode(self) -> bytes:
        return json.dumps({"handover": "vllm-layerwise", "v": VERSION, **self.to_json()},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LayerwiseTicket:
        if len(raw) > MAX_MESSAGE:
            raise WireError(f"a ticket of {len(raw)} bytes")
        try:
            d = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise WireError("the ticket is not JSON") from None
        if not isinstance(d, dict) or d.get("handover") != "vllm-layerwise":
            raise WireError("not a vLLM layer-wise ticket (the decode worker runs another engine or connector)")
        if d.get("v") != VERSION:
            raise WireError(f"vLLM layer-wise ticket version {d.get('v')!r}; this worker speaks {VERSION}")
        return cls.from_json({k: v for k, v in d.items() if k not in ("handover", "v")})

    @classmethod
    def from_json(cls, d: Any) -> LayerwiseTicket:
        if not isinstance(d, dict):
            raise WireError("ticket: not an object")
        missing = set(cls.__dataclass_fields__) - set(d)
        extra = set(d) - set(cls.__dataclass_fields__)
        if missing or extra:
            raise WireError(f"ticket fields: missing {sorted(missing)}, unknown {sorted(extra)}")
        blocks = d["block_ids"]
        if not isinstance(blocks, list) or not 1 <= len(blocks) <= MAX_BLOCKS:
            raise WireError("ticket.block_ids: not a list of 1..2^20 block ids")
        for b in blocks:
            _int(b, "ticket.block_ids[]", 0, 1 << 40)
        t = cls(key=_key(d["key"], "ticket.key"), engine=_key(d["engine"], "ticket.engine"),
                dp_rank=_int(d["dp_rank"], "ticket.dp_rank", 0, MAX_RANKS),
                tp_size=_int(d["tp_size"], "ticket.tp_size", 1, MAX_RANKS), host=_host(d["host"], "ticket.host"),
                port=_int(d["port"], "ticket.port", 1, 65535), block_size=_int(d["block_size"], "ticket.block_size",
                                                                                 1, 1 << 16),
                first_block=_int(d["first_block"], "ticket.first_block", 0, MAX_BLOCKS),
                block_ids=tuple(blocks), num_tokens=_int(d["num_tokens"], "ticket.num_tokens", 1, 1 << 40),
                deadline=_number(d["deadline"], "ticket.deadline", 0, 1e12))
        need = -(-t.num_tokens // t.block_size) - t.first_block
        if need != len(t.block_ids):
            raise WireError(f"ticket: {len(t.block_ids)} block ids for {need} blocks of the prompt")
        return t

    def rank_endpoint(self, rank: int) -> str:
        return f"tcp://{_bracket(self.host)}:{self.port + self.dp_rank * self.tp_size + rank}"


# == control messages (the worker <-> the connectors inside its vLLM server) =====================================
# In-vLLM -> worker:
#   hello     {side: scheduler|worker, dp, rank, engine, pid}     every HELLO_S (the worker learns who listens)
#   reserved  {key, engine, dp, tp, first_block, block_ids, num_tokens}   a decode reservation has its blocks
#   landed    {key, ok, bytes, reason, rank}                       a reservation ended (ok: its KV is in place)
#   sent      {key, ok, bytes, reason, rank}                       a producer's transfer ended
#   transport {peer, host, transport, local_mem, remote_mem, rank} what NIXL uses toward a peer (`ucx_transport`)
#   dropped   {peer, host, rank}                                a peer's agent was dropped (gone, or replaced)
# Worker -> in-vLLM:
#   ticket    {key, ticket}     a producer request's ticket (workers)
#   drop      {key}             a producer request's ticket will not come (workers)
#   release   {key}             a reservation's ticket was never published: nothing can land, free it (workers)
HELLO_S = 2.0
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"side": str, "dp": int, "rank": int, "engine": str, "pid": int},
    "reserved": {"key": str, "engine": str, "dp": int, "tp": int, "first_block": int, "block_ids": list,
                 "num_tokens": int},
    "landed": {"key": str, "ok": bool, "bytes": int, "reason": str, "rank": int},
    "sent": {"key": str, "ok": bool, "bytes": int, "reason": str, "rank": int},
    "transport": {"peer": str, "host": str, "transport": str, "local_mem": str, "remote_mem": str, "rank": int},
    "dropped": {"peer": str, "host": str, "rank": int},
    "ticket": {"key": str, "ticket": dict},
    "drop": {"key": str},
    "release": {"key": str},
}


def encode_message(kind: str, **fields: Any) -> bytes:
    if kind not in _FIELDS or set(fields) != set(_FIELDS[kind]):
        raise WireError(f"control message {kind!r}: fields {sorted(fields)}")
    return json.dumps({"t": kind, "v": VERSION, **fields}, separators=(",", ":")).encode()


def decode_message(raw: bytes) -> tuple[str, dict[str, Any]]:
    """(kind, fields) of a control message; `WireError` names what does not fit."""
    if len(raw) > MAX_MESSAGE:
        raise WireError(f"a control message of {len(raw)} bytes")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise WireError("a control message that is not JSON") from None
    if not isinstance(d, dict):
        raise WireError("a control message that is not an object")
    kind = d.pop("t", None)
    if d.pop("v", None) != VERSION:
        raise WireError(f"control message version; this side speaks {VERSION}")
    spec = _FIELDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise WireError(f"unknown control message {str(kind)[:40]!r}")
    if set(d) != set(spec):
        raise WireError(f"control message {kind!r}: fields {sorted(d)}")
    for name, typ in spec.items():
        value = d[name]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise WireError(f"control message {kind!r}: {name} is not a {getattr(typ, '__name__', typ)}")
        if isinstance(value, str) and len(value) > 4096:
            raise WireError(f"control message {kind!r}: {name} is too long")
    if "key" in d:
        _key(d["key"], f"{kind}.key")
    if kind == "reserved":
        blocks = d["block_ids"]
        if len(blocks) > MAX_BLOCKS or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                               for b in blocks):
            raise WireError("reserved.block_ids: not block ids")
    return kind, d


# == NIXL metadata (a decode rank's answer to a prefill rank) ===================================================
@dataclass(frozen=True)
class Region:
    """One layer's K, V or joint K/V cache as NIXL sees it: `num_blocks` blocks of `block_bytes` bytes, `stride`
    bytes apart from `addr`."""

    addr: int
    block_bytes: int
    stride: int
    num_blocks: int


@dataclass(frozen=True)
class AgentInfo:
    """A rank's NIXL agent: its name and metadata, and its KV cache regions, layer by layer (the same number per
    layer), in the order the writes index them."""

    agent: str
    metadata: bytes
    mem_type: str  # DRAM | VRAM
    device_id: int
    regions_per_layer: int
    regions: tuple[Region, ...]

    def encode(self) -> bytes:
        return json.dumps({"v": VERSION, "agent": self.agent, "metadata": base64.b64encode(self.metadata).decode(),
                           "mem_type": self.mem_type, "device_id": self.device_id,
                           "regions_per_layer": self.regions_per_layer,
                           "regions": [[r.addr, r.block_bytes, r.stride, r.num_blocks] for r in self.regions]},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> AgentInfo:
        if len(raw) > 64 << 20:
            raise WireError("agent metadata larger than 64 MiB")
        try:
            d = json.loads(raw)
            meta = base64.b64decode(d["metadata"], validate=True)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, binascii.Error):
            raise WireError("agent metadata: not JSON with base64 NIXL metadata") from None
        if d.get("v") != VERSION:
            raise WireError(f"agent metadata version {d.get('v')!r}; this side speaks {VERSION}")
        if d.get("mem_type") not in ("DRAM", "VRAM"):
            raise WireError("agent metadata: mem_type is not DRAM or VRAM")
        per = _int(d.get("regions_per_layer"), "agent.regions_per_layer", 1, 8)
        rows = d.get("regions")
        if not isinstance(rows, list) or not rows or len(rows) % per or len(rows) > 4096:
            raise WireError("agent metadata: regions")
        regions = []
        for row in rows:
            if not isinstance(row, list) or len(row) != 4:
                raise WireError("agent metadata: a region is not [addr, block bytes, stride, blocks]")
            addr, bb, stride, n = (_int(x, "agent.region", 0, 1 << 62) for x in row)
            if bb < 1 or stride < bb or n < 1:
                raise WireError("agent metadata: a region's block bytes, stride or block count")
            regions.append(Region(addr, bb, stride, n))
        return cls(_key(d.get("agent"), "agent.agent"), meta, d["mem_type"],
                   _int(d.get("device_id"), "agent.device_id", 0, 1 << 16), per, tuple(regions))

    @property
    def num_layers(self) -> int:
        return len(self.regions) // self.regions_per_layer

    def shape(self) -> tuple[int, tuple[int, ...]]:
        """(layers, block bytes of each region of a layer): what must match between the two sides."""
        return self.num_layers, tuple(r.block_bytes for r in self.regions[:self.regions_per_layer])


# == NIXL notifications (prefill rank -> decode rank) ============================================================
NOTICE_PREFIX = "ssL1"


def done_notice(key: str, nbytes: int) -> bytes:
    """Every layer of every block of the reservation is in place (sent once every write completed)."""
    return f"{NOTICE_PREFIX}|D|{key}|{nbytes}".encode()


def abort_notice(key: str, reason: str) -> bytes:
    """This sender stopped: it posts no more writes, and those it posted completed (or its deadline passed)."""
    return f"{NOTICE_PREFIX}|A|{key}|{reason[:200].replace('|', '/')}".encode()


def parse_notice(raw: bytes) -> tuple[str, str, int, str] | None:
    """(kind D|A, key, bytes, reason) of one of our notices; None for another sender's (not ours to read)."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    parts = text.split("|", 3)
    if len(parts) != 4 or parts[0] != NOTICE_PREFIX or parts[1] not in ("D", "A") or not _KEY.fullmatch(parts[2]):
        return None
    if parts[1] == "D":
        if not (parts[3].isascii() and parts[3].isdigit() and len(parts[3]) <= 18):
            return None
        return "D", parts[2], int(parts[3]), ""
    return "A", parts[2], 0, parts[3]


# == field checks =================================================================================================
def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise WireError(f"{name}: {str(value)[:40]!r} is not an integer in {lo}..{hi}")
    return value


def _number(value: Any, name: str, lo: float, hi: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise WireError(f"{name}: {str(value)[:40]!r} is not a number in {lo}..{hi}")
    return float(value)


def _key(value: Any, name: str) -> str:
    if not isinstance(value, str) or not _KEY.fullmatch(value) or "|" in value:
        raise WireError(f"{name}: not 1..{MAX_KEY} printable characters without '|'")
    return value


def _host(value: Any, name: str) -> str:
    if not isinstance(value, str) or not _HOST.fullmatch(value):
        raise WireError(f"{name}: {str(value)[:60]!r} is not a host")
    return value


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def now() -> float:
    """Deadlines are unix seconds: both servers' clocks (NTP on one cluster) read them."""
    return time.time()
