"""KV transfer over plain TCP: length-prefixed frames whose payload is received straight into the destination
tensors' memory (CPU) or a pinned staging buffer (CUDA). Works on any cluster; NIXL is the fast path.

Frame: header | request id | runs | payload
  header = magic "SKV2", kind (1 data, 2 abort), final flag, kv (0 K, 1 V), sender rank, request-id length,
           senders routed to this receiver, layer, number of runs, payload bytes, crc32 of the payload,
           first head (within the receiver's shard), number of heads
  runs   = (destination block, count) pairs, each u32
  payload = per block of each run, [block_size, heads, head_dim] of the route's heads (the sender slices them
            out of its shard; the receiver writes them into its own, straight into the tensor when the frame
            covers every head it holds, else through a staging buffer)
The receiver checks every field against what it expects before reading a byte of payload.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import zlib
from dataclasses import dataclass

import torch

from splitserve.kv_transfer.errors import TransferError
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.shards import Route
from splitserve.kv_transfer.ticket import TransferTicket

log = logging.getLogger("splitserve.kv_transfer.tcp")

MAGIC = b"SKV2"
# magic kind final kv src rid_len num_src head_off head_count (pad) layer num_runs payload crc: 32 bytes
HEADER = struct.Struct("<4sBBBBHBBBxHIQI")
RUN = struct.Struct("<II")
KIND_DATA, KIND_ABORT = 1, 2
MAX_RUNS = 1 << 20
RECV_CHUNK = 4 << 20


class FrameError(Exception):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, RECV_CHUNK))
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


class TcpBackend:
    name = "tcp"
    one_sided = False  # we write each frame into the blocks ourselves (counted: `KVTransferAgent.begin_write`)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, io_timeout: float = 30.0) -> None:
        self.host = host
        self.io_timeout = io_timeout
        self._server = socket.create_server((host, port), reuse_port=False)
        self.port = self._server.getsockname()[1]
        self._agent = None
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    # -- receiver ----------------------------------------------------------------------------------
    def start(self, agent) -> None:
        self._agent = agent
        threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True).start()

    def endpoint_fields(self) -> dict:
        return {"endpoint": f"{self.host}:{self.port}"}

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            conn.settimeout(self.io_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One sender's connection, frame after frame until it closes; a frame that fails a check drops it."""
        frames = _FrameReader(conn, self._agent)
        try:
            while (frame := frames.next_header()) is not None:
                frames.receive(frame)
        except (FrameError, OSError, ConnectionError) as e:
            log.warning("kv tcp: dropping connection: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            frames.close()

    # -- sender ------------------------------------------------------------------------------------
    def open_channel(self, ticket: TransferTicket, route: Route) -> TcpChannel:
        return TcpChannel(self._agent.layout, ticket, route, self.io_timeout)

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@dataclass(frozen=True)
class _Frame:
    """A frame's header and request id, as read (checked against a ticket by `_FrameReader`)."""

    rid: str
    kind: int  # KIND_DATA | KIND_ABORT
    final: int
    kv: int  # 0 K, 1 V
    src: int  # the sender's rank
    num_src: int  # senders routed to this receiver
    head_off: int  # first head, within the receiver's shard
    head_count: int
    layer: int
    num_runs: int
    payload: int  # bytes
    crc: int  # crc32 of the payload


class _FrameReader:
    """The receiving end of one sender's connection: reads each frame, checks every field against its request's
    ticket before reading a byte of payload, and writes the payload into the ticket's blocks."""

    def __init__(self, conn: socket.socket, agent) -> None:
        self.conn = conn
        self.agent = agent
        self.layout: KVLayout = agent.layout
        self.seen: dict[str, int] = {}  # request -> sender rank carried here: it fails if this drops mid-stream
        self.staging = torch.empty(0, dtype=torch.uint8, pin_memory=self.layout.is_cuda)
        self.writing: str | None = None  # whose frame is being written (the agent counts it until it ends)

    def next_header(self) -> _Frame | None:
        """The next frame's header and request id; None once the sender closed the connection."""
        try:
            head = _recv_exact(self.conn, HEADER.size)
        except ConnectionError:
            return None
        (magic, kind, final, kv, src, rid_len, num_src, head_off, head_count, layer, num_runs, payload,
         crc) = HEADER.unpack(head)
        if magic != MAGIC or kind not in (KIND_DATA, KIND_ABORT) or not 0 < rid_len <= 256:
            raise FrameError(f"bad frame header {head[:8]!r}")
        try:
            rid = _recv_exact(self.conn, rid_len).decode()
        except UnicodeDecodeError:
            raise FrameError("request id is not UTF-8") from None
        return _Frame(rid, kind, final, kv, src, num_src, head_off, head_count, layer, num_runs, payload, crc)

    def receive(self, f: _Frame) -> None:
        """The rest of one frame: an abort fails its request; data lands in its blocks, or the connection drops."""
        ticket = self.agent.begin_write(f.rid)
        if ticket is None:
            raise FrameError(f"frame for unknown or finished request {f.rid!r}")
        self.writing = f.rid
        self.seen[f.rid] = f.src
        if f.kind == KIND_ABORT:
            self.agent.fail(f.rid, TransferError(f"{f.rid}: sender aborted"))
        else:
            self._check_fields(f, ticket)
            runs = self._read_runs(f, ticket)
            self._write_payload(f, runs)
            self.agent.landed(f.rid, f.layer, (f.kv,), bool(f.final), f.payload, f.src, f.num_src)
        self.writing = None
        self.agent.end_write(f.rid)

    def _check_fields(self, f: _Frame, ticket: TransferTicket) -> None:
        if f.layer >= ticket.num_layers or f.kv > 1 or f.num_runs > MAX_RUNS or f.final > 1 or \
                f.num_src < 1 or f.head_count < 1 or f.head_off + f.head_count > self.layout.num_heads:
            raise FrameError(f"{f.rid}: frame fields out of range (layer={f.layer}, kv={f.kv}, heads "
                             f"{f.head_off}+{f.head_count}, {f.num_src} senders)")

    def _read_runs(self, f: _Frame, ticket: TransferTicket) -> list[tuple[int, int]]:
        """The frame's (destination block, count) runs: inside its ticket, and adding up to its payload."""
        raw = _recv_exact(self.conn, f.num_runs * RUN.size)
        runs = [RUN.unpack_from(raw, i * RUN.size) for i in range(f.num_runs)]
        allowed = set(ticket.block_ids[ticket.skip_blocks:])
        total = 0
        for start, n in runs:
            if n == 0 or any(b not in allowed for b in range(start, start + n)):
                raise FrameError(f"{f.rid}: frame writes blocks outside its ticket")
            total += n
        need = total * self._block_bytes(f)
        if f.payload != need:
            raise FrameError(f"{f.rid}: payload {f.payload} bytes, runs need {need}")
        return runs

    def _block_bytes(self, f: _Frame) -> int:
        """Bytes of one block of the frame (its heads only)."""
        return self.layout.block_size * f.head_count * self.layout.head_bytes

    def _write_payload(self, f: _Frame, runs: list[tuple[int, int]]) -> None:
        """Each run's blocks straight into the KV tensor (CPU, the frame covers every head this shard holds),
        else through the staging buffer; then the checksum, which fails the request when it does not match."""
        layout = self.layout
        whole = f.head_count == layout.num_heads  # the frame's blocks are contiguous in our tensor
        bb = self._block_bytes(f)
        dest = layout.byte_view(f.layer, f.kv)
        heads = layout.heads_view(f.layer, f.kv, f.head_off, f.head_count)
        check = 0
        for start, n in runs:
            size = n * bb
            if whole and not layout.is_cuda:
                view = memoryview(dest[start * bb : start * bb + size].numpy())
                _recv_into(self.conn, view)
            else:
                if self.staging.numel() < size:
                    self.staging = torch.empty(size, dtype=torch.uint8, pin_memory=layout.is_cuda)
                view = memoryview(self.staging[:size].numpy())
                _recv_into(self.conn, view)
                part = self.staging[:size].view(heads.dtype).view(n, *heads.shape[1:])
                heads[start : start + n].copy_(part)  # [n, block_size, head_count, head_dim]
            check = zlib.crc32(view, check)
        if check != f.crc:
            self.agent.fail(f.rid, TransferError(f"{f.rid}: checksum mismatch on layer {f.layer}"))
            raise FrameError(f"{f.rid}: checksum mismatch")

    def close(self) -> None:
        """The connection ended: a frame cut short writes nothing more, and a request whose sender left before
        it finished fails."""
        if self.writing is not None:
            self.agent.end_write(self.writing)
        for rid, src in self.seen.items():
            if self.agent.lookup(rid) is not None and not self.agent.sender_done(rid, src):
                self.agent.fail(rid, TransferError(f"{rid}: sender disconnected before the transfer completed"))


class TcpChannel:
    def __init__(self, layout: KVLayout, ticket: TransferTicket, route: Route, io_timeout: float) -> None:
        self.layout = layout
        self.ticket = ticket
        self.route = route
        host, _, port = ticket.ranks[route.dst_rank].endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=io_timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rid = ticket.request_id.encode()

    def _header(self, kind: int, final: bool, kv: int, layer: int, num_runs: int, payload: int, crc: int) -> bytes:
        r = self.route
        return HEADER.pack(MAGIC, kind, int(final), kv, r.src_rank, len(self.rid), r.num_src, r.dst_offset,
                           r.num_heads, layer, num_runs, payload, crc)

    def write_layer(self, layer: int, runs: list[tuple[int, int, int]], final: bool) -> int:
        if not runs and not final:
            return 0
        r = self.route
        sent = 0
        for kv in (0, 1):
            heads = self.layout.heads_view(layer, kv, r.src_offset, r.num_heads)  # [blocks, bs, heads, dim]
            parts = []
            for s, _, n in runs:
                region = heads[s : s + n].contiguous().view(-1).view(torch.uint8)  # a copy only when sliced
                parts.append(memoryview(region.cpu().numpy() if region.is_cuda else region.numpy()))
            crc = 0
            for p in parts:
                crc = zlib.crc32(p, crc)
            payload = sum(len(p) for p in parts)
            head = self._header(KIND_DATA, final, kv, layer, len(runs), payload, crc)
            self.sock.sendall(head + self.rid + b"".join(RUN.pack(d, n) for _, d, n in runs))
            for p in parts:
                self.sock.sendall(p)
            sent += payload
        return sent

    def write_layers(self, layers: range, runs: list[tuple[int, int, int]], final: bool) -> int:
        return sum(self.write_layer(layer, runs, final) for layer in layers)  # frames carry one layer each

    def write_all(self, runs: list[tuple[int, int, int]]) -> int:
        return self.write_layers(range(self.layout.num_layers), runs, True)

    def flush(self) -> None:
        pass  # writes are synchronous

    def poll(self) -> None:
        pass

    def abort(self) -> None:
        self.sock.sendall(self._header(KIND_ABORT, False, 0, 0, 0, 0, 0) + self.rid)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
