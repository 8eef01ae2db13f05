"""A KV sender in its own process for the transfer tests, and `Peer`, the tests' handle on that process.

The process reads JSON commands on stdin, sends, and reports one JSON line per outcome on stdout. Its KV cache
is random with a fixed seed, so the test process can rebuild the expected bytes. `Peer` watches the process
whenever it waits on it: a peer that dies, at start or later, raises `PeerDied` within a fraction of a second,
naming its exit code and last stderr lines, instead of leaving the test to an outer timeout.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time

import torch

from splitserve.common.proc import ChildDied, JsonLinesChild
from splitserve.kv_transfer import KVLayout, TransferTicket, make_agent

SHAPE = dict(num_layers=6, num_blocks=96, block_size=16, heads=2, head_dim=32)
START_S = 60.0  # seconds a peer may take to report ready (torch import, agent start)
READ_S = 30.0  # seconds to wait for any later report


def make_kv(seed: int, dtype=torch.float32, fill: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (SHAPE["num_blocks"], SHAPE["block_size"], SHAPE["heads"], SHAPE["head_dim"])
    out = []
    for _ in range(SHAPE["num_layers"]):
        if fill:
            out.append((torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)))
        else:
            out.append((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
    return out


PeerDied = ChildDied


class Peer(JsonLinesChild):
    """The test side: starts `kv_peer.py BACKEND SEED`, sends it commands, reads its reports."""

    def __init__(self, backend: str, seed: int) -> None:
        super().__init__([sys.executable, __file__, backend, str(seed)], "peer")
        try:
            ready = self.read(START_S)
        except TimeoutError:
            self.close()
            raise
        if ready.get("ready") != backend:
            self.close()
            raise PeerDied(f"peer started backend {ready.get('ready')!r}, not {backend!r}")

    def send(self, ticket: TransferTicket, src: list[int], **kw) -> None:
        self.send_json({"ticket": base64.b64encode(ticket.encode()).decode(), "src": src, **kw})

    def read(self, timeout: float = READ_S) -> dict:
        """The next report; raises PeerDied once the process is gone, TimeoutError after `timeout` seconds."""
        return self.recv_json(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.kill()
            self.proc.wait(5)


def main() -> None:
    backend, seed = sys.argv[1], int(sys.argv[2])
    reports = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of libraries (NIXL, UCX) go to stderr, never into the reports
    lock = threading.Lock()  # one report line at a time from the session threads

    def report(msg: dict) -> None:
        with lock:
            print(json.dumps(msg), file=reports)

    agent = make_agent(backend, KVLayout(make_kv(seed)))
    report({"ready": agent.backend.name})

    def run(cmd: dict) -> None:
        try:
            ticket = TransferTicket.decode(base64.b64decode(cmd["ticket"]))
            session = agent.begin(ticket, cmd["src"])
            for i, layer in enumerate(cmd.get("layers") or range(SHAPE["num_layers"])):
                if cmd.get("stop_after") is not None and i >= cmd["stop_after"]:
                    report({"stalled": ticket.request_id})
                    return  # stall: never finish (the receiver's deadline must catch it)
                session.send_layer(layer)
                time.sleep(cmd.get("delay", 0.0))
            session.finish()
            report({"done": ticket.request_id, "bytes": session.bytes})
        except Exception as e:
            report({"error": str(e), "type": type(e).__name__})

    for line in sys.stdin:
        cmd = json.loads(line)
        threading.Thread(target=run, args=(cmd,), daemon=True).start()


if __name__ == "__main__":
    main()
