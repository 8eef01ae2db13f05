"""A KV sender in its own process, for the transfer tests: reads JSON commands on stdin, sends, reports.

Its KV cache is random with a fixed seed, so the test process can rebuild the expected bytes.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time

import torch

from splitserve.kv_transfer import KVLayout, TransferTicket, make_agent

SHAPE = dict(num_layers=6, num_blocks=96, block_size=16, heads=2, head_dim=32)


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


def main() -> None:
    backend, seed = sys.argv[1], int(sys.argv[2])
    agent = make_agent(backend, KVLayout(make_kv(seed)))
    print(json.dumps({"ready": agent.backend.name}), flush=True)

    def run(cmd: dict) -> None:
        try:
            ticket = TransferTicket.decode(base64.b64decode(cmd["ticket"]))
            session = agent.begin(ticket, cmd["src"])
            for i, layer in enumerate(cmd.get("layers") or range(SHAPE["num_layers"])):
                if cmd.get("stop_after") is not None and i >= cmd["stop_after"]:
                    print(json.dumps({"stalled": ticket.request_id}), flush=True)
                    return  # stall: never finish (the receiver's deadline must catch it)
                session.send_layer(layer)
                time.sleep(cmd.get("delay", 0.0))
            session.finish()
            print(json.dumps({"done": ticket.request_id, "bytes": session.bytes}), flush=True)
        except Exception as e:
            print(json.dumps({"error": str(e), "type": type(e).__name__}), flush=True)

    for line in sys.stdin:
        cmd = json.loads(line)
        threading.Thread(target=run, args=(cmd,), daemon=True).start()


if __name__ == "__main__":
    main()
