"""A vLLM server that cannot bind a port picked for it starts again on other ports. A port picked free stays free
only until the server binds it, seconds later; another process's connection or listener can take it meanwhile
(seen with two test processes' clusters starting at once: the restarted worker's server died with "Address
already in use"). Here the first pick of the server's HTTP port is one this test holds; the real server fails to
bind it, and the worker's launch starts it again on ports it picks anew."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest

from splitserve.common.config_file import load

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "deploy/examples/local-cpu.yaml"


@pytest.mark.timeout(600)
def test_a_vllm_server_whose_port_was_taken_starts_again_on_other_ports(monkeypatch, caplog):
    from splitserve.vllm_engine import launch as vllm_launch

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    picks: list[list[int]] = []
    pick = vllm_launch.free_ports

    def first_one_taken(n: int, host: str = "127.0.0.1") -> list[int]:
        ports = pick(n, host)
        if not picks:
            ports[0] = taken  # the HTTP port
        picks.append(ports)
        return ports

    monkeypatch.setattr(vllm_launch, "free_ports", first_one_taken)
    spec = load(EXAMPLE, {"mode": "colocated", "engine": "vllm"}).spec
    caplog.set_level(logging.WARNING, logger="splitserve.vllm")

    async def main() -> tuple[str, int]:
        engine = await vllm_launch.launch(spec, "both", "127.0.0.1")
        try:
            return engine.base_url, engine.facts.max_model_len
        finally:
            await engine.aclose()
            engine.shutdown()

    try:
        url, max_len = asyncio.run(main())
    finally:
        held.close()
    assert len(picks) == 2 and picks[1][0] != taken
    assert url.endswith(f":{picks[1][0]}") and max_len > 0
    assert any("starting it again on other ports (attempt 2 of 3)" in r.getMessage() for r in caplog.records)
