"""KV transfer over plain TCP: length-prefixed frames whose payload is received straight into the destination
tensors' memory (CPU) or a pinned staging buffer (CUDA). Works on any cluster; NIXL is the fast path.

Frame: header | request id | runs | payload
  header = magic "SKV1", kind (1 data, 2 abort), final flag, kv (0 K, 1 V), request-id length,
           layer, number of runs, payload bytes, crc32 of the payload
  runs   = (destination block, count) pairs, each u32
The receiver checks every field against the ticket it issued before reading a byte of payload.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import zlib

import torch

from splitserve.kv_transfer.errors import TransferError
from splitserve.kv_transfer.layout import KVLayout
from splitserve.kv_transfer.ticket import TransferTicket

log = logging.getLogger("splitserve.kv_transfer.tcp")

MAGIC = b"SKV1"
HEADER = struct.Struct("<4sBBBxHxxIIQI")  # magic kind final kv rid_len layer num_runs payload crc
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

    def ticket_fields(self) -> dict:
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
        agent = self._agent
        layout: KVLayout = agent.layout
        seen: set[str] = set()  # requests this connection carried: they fail if it drops mid-stream
        staging = torch.empty(0, dtype=torch.uint8, pin_memory=layout.is_cuda)
        try:
            while True:
                try:
                    head = _recv_exact(conn, HEADER.size)
                except ConnectionError:
                    break
                magic, kind, final, kv, rid_len, layer, num_runs, payload, crc = HEADER.unpack(head)
                if magic != MAGIC or kind not in (KIND_DATA, KIND_ABORT) or not 0 < rid_len <= 256:
                    raise FrameError(f"bad frame header {head[:8]!r}")
                try:
                    rid = _recv_exact(conn, rid_len).decode()
                except UnicodeDecodeError:
                    raise FrameError("request id is not UTF-8") from None
                ticket = agent.lookup(rid)
                if ticket is None:
                    raise FrameError(f"frame for unknown or finished request {rid!r}")
                seen.add(rid)
                if kind == KIND_ABORT:
                    agent.fail(rid, TransferError(f"{rid}: sender aborted"))
                    continue
                if layer >= ticket.num_layers or kv > 1 or num_runs > MAX_RUNS or final > 1:
                    raise FrameError(f"{rid}: frame fields out of range (layer={layer}, kv={kv})")
                raw = _recv_exact(conn, num_runs * RUN.size)
                runs = [RUN.unpack_from(raw, i * RUN.size) for i in range(num_runs)]
                allowed = set(ticket.block_ids[ticket.skip_blocks:])
                total = 0
                for start, n in runs:
                    if n == 0 or any(b not in allowed for b in range(start, start + n)):
                        raise FrameError(f"{rid}: frame writes blocks outside its ticket")
                    total += n
                bb = layout.block_bytes
                if payload != total * bb:
                    raise FrameError(f"{rid}: payload {payload} bytes, runs need {total * bb}")
                dest = layout.byte_view(layer, kv)
                check = 0
                for start, n in runs:
                    size = n * bb
                    if layout.is_cuda:
                        if staging.numel() < size:
                            staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                        view = memoryview(staging[:size].numpy())
                        _recv_into(conn, view)
                        dest[start * bb : start * bb + size].copy_(staging[:size])
                    else:
                        view = memoryview(dest[start * bb : start * bb + size].numpy())
                        _recv_into(conn, view)
                    check = zlib.crc32(view, check)
                if check != crc:
                    agent.fail(rid, TransferError(f"{rid}: checksum mismatch on layer {layer}"))
                    raise FrameError(f"{rid}: checksum mismatch")
                agent.landed(rid, layer, (kv,), bool(final), payload)
        except (FrameError, OSError, ConnectionError) as e:
            log.warning("kv tcp: dropping connection: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            for rid in seen:
                if agent.lookup(rid) is not None:
                    agent.fail(rid, TransferError(f"{rid}: sender disconnected before the transfer completed"))

    # -- sender ------------------------------------------------------------------------------------
    def open_channel(self, ticket: TransferTicket) -> TcpChannel:
        return TcpChannel(self._agent.layout, ticket, self.io_timeout)

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


class TcpChannel:
    def __init__(self, layout: KVLayout, ticket: TransferTicket, io_timeout: float) -> None:
        self.layout = layout
        self.ticket = ticket
        host, _, port = ticket.endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=io_timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rid = ticket.request_id.encode()

    def write_layer(self, layer: int, runs: list[tuple[int, int, int]], final: bool) -> int:
        if not runs and not final:
            return 0
        bb = self.layout.block_bytes
        sent = 0
        for kv in (0, 1):
            src = self.layout.byte_view(layer, kv)
            parts = []
            for s, _, n in runs:
                region = src[s * bb : (s + n) * bb]
                parts.append(memoryview(region.cpu().numpy() if region.is_cuda else region.numpy()))
            crc = 0
            for p in parts:
                crc = zlib.crc32(p, crc)
            payload = sum(len(p) for p in parts)
            head = HEADER.pack(MAGIC, KIND_DATA, int(final), kv, len(self.rid), layer, len(runs), payload, crc)
            self.sock.sendall(head + self.rid + b"".join(RUN.pack(d, n) for _, d, n in runs))
            for p in parts:
                self.sock.sendall(p)
            sent += payload
        return sent

    def write_all(self, runs: list[tuple[int, int, int]]) -> int:
        return sum(self.write_layer(layer, runs, True) for layer in range(self.layout.num_layers))

    def flush(self) -> None:
        pass  # writes are synchronous

    def poll(self) -> None:
        pass

    def abort(self) -> None:
        head = HEADER.pack(MAGIC, KIND_ABORT, 0, 0, len(self.rid), 0, 0, 0, 0)
        self.sock.sendall(head + self.rid)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
