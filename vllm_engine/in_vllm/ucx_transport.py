"""Which transport UCX (under NIXL) actually picked toward a peer, read from UCX's own protocol-selection tables.

With `UCX_PROTO_INFO=y` UCX logs, for each new endpoint configuration, a table per operation: its header names the
local worker, the peer's scope (`self`, `intra-node`, `inter-node`) and the configuration, then the operation
("remote memory write by ucp_put* from cuda memory to cuda"), then one row per message size range with the
transport lanes serving it ("cuda_ipc/cuda", "rc_mlx5/mlx5_0:1", "tcp/eth0", "50% on rc_mlx5/... and 50% on
..."). `UCX_LOG_FILE` puts them in a file of the process's own (`%p`); `UcxLog` reads what is new since its last
read and keeps the largest-size row of each put table. A peer is attributed the table that appeared when it was
first written to, or else (its endpoint reused a configuration already logged) the latest put table of a remote
scope. Plain Python, no UCX import.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("splitserve.vllm_layerwise")

LOG_DIR_ENV = "SPLITSERVE_UCX_LOG_DIR"
_HEADER = re.compile(r"^\|\s*(\S+)\s+(self|intra-node|inter-node)\s+cfg#(\d+)\s*\|\s*$")
_PUT = re.compile(r"remote memory write by ucp_put\S* .*from (\w+) memory to (\w+)")
_ROW = re.compile(r"^\|\s*([0-9.]+(?:\.\.[0-9a-z]+)?)\s*\|[^|]*\|\s*(.+?)\s*\|\s*$")
_RDMA = ("rc", "dc", "ud", "ib", "mlx5", "gga", "srd", "efa", "roce")
_SHM = ("cma", "knem", "xpmem", "sysv", "posix", "shm")


@dataclass(frozen=True)
class PutTable:
    worker: str
    scope: str  # intra-node | inter-node
    config: int
    src_mem: str  # host | cuda
    dst_mem: str
    lanes: str  # the largest messages' row, as UCX wrote it

    @property
    def transport(self) -> str:
        return classify(self.lanes)


def classify(lanes: str) -> str:
    """cuda_ipc, rdma, tcp, shm (shared memory / CMA on one host), cuda_copy, or the transport's own name."""
    names = re.findall(r"([a-z0-9_]+)/", lanes)
    kinds = []
    for name in names:
        if name == "cuda_ipc":
            kinds.append("cuda_ipc")
        elif name == "tcp":
            kinds.append("tcp")
        elif name.startswith(_RDMA) or "mlx" in name:
            kinds.append("rdma")
        elif name.startswith(_SHM):
            kinds.append("shm")
        else:
            kinds.append(name)
    if not kinds:
        return "unknown"
    # several lanes: the slowest kind names it (a TCP lane beside an RDMA one is still traffic over TCP)
    for kind in ("tcp", "shm", "cuda_copy", "rdma", "cuda_ipc"):
        if kind in kinds:
            return kind
    return kinds[0]


def parse(lines: list[str]) -> list[PutTable]:
    """The put tables in UCX log lines (each line may carry UCX's "[time] [host:pid:thread]" prefix)."""
    out: list[PutTable] = []
    header: tuple[str, str, int] | None = None
    put: tuple[str, str] | None = None
    lanes = ""
    for raw in lines:
        line = re.sub(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*", "", raw.rstrip("\n"))
        if m := _HEADER.match(line):
            if header and put and lanes:
                out.append(PutTable(*header, *put, lanes))
            header, put, lanes = (m.group(1), m.group(2), int(m.group(3))), None, ""
            continue
        if header is None:
            continue
        if put is None and (m := _PUT.search(line)):
            put = (m.group(1), m.group(2))
            continue
        if put is not None and (m := _ROW.match(line)):
            lanes = m.group(2)  # rows go by increasing size: the last is the largest messages'
            if m.group(1).endswith("inf"):
                out.append(PutTable(*header, *put, lanes))
                header, put, lanes = None, None, ""
    if header and put and lanes:
        out.append(PutTable(*header, *put, lanes))
    return out


class UcxLog:
    """This process's UCX log file (`UCX_LOG_FILE` set by `configure` before UCX starts), read incrementally."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._offset = 0
        self.tables: list[PutTable] = []

    @classmethod
    def configure(cls) -> UcxLog:
        """Ask UCX for its tables in a file of this process's own, unless the environment already says where UCX
        logs (then nothing is read). Call before this process's first NIXL agent exists."""
        directory = os.environ.get(LOG_DIR_ENV, "")
        if not directory or "UCX_LOG_FILE" in os.environ:
            return cls(None)
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("UCX transport report off: cannot create %s (%s)", directory, e)
            return cls(None)
        os.environ.setdefault("UCX_PROTO_INFO", "y")
        os.environ["UCX_LOG_FILE"] = str(Path(directory) / "ucx.%p.log")
        return cls(Path(directory) / f"ucx.{os.getpid()}.log")

    def read(self) -> list[PutTable]:
        """Tables logged since the last read (UCX warnings and errors among the lines go to our log)."""
        if self.path is None:
            return []
        _flush_stdio()  # UCX writes its log through a buffered FILE of this process
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except OSError:
            return []
        lines = text.splitlines()
        for line in lines:
            if " UCX  WARN " in line or " UCX  ERROR " in line:
                log.warning("ucx: %s", line.strip()[:300])
        new = parse(lines)
        self.tables.extend(new)
        return new

    def transport_for(self, worker: str) -> PutTable | None:
        """The latest put table of worker `worker` (UCX shortens the name it logs) toward a peer, not itself."""
        for t in reversed(self.tables):
            if worker.startswith(t.worker) and t.scope != "self":
                return t
        return None


def _flush_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask: the tables come when UCX's buffer fills
        pass
