"""`splitserve serve-ray` end to end on a local Ray (2 CPUs, no dashboard, loopback only): deploy
deploy/examples/local-cpu.yaml, stream an answer through the `openai` client, step the load (the control law,
as Serve's autoscaling policy, adds a replica within its scale-up cooldown), kill a worker replica (it is
replaced and requests keep succeeding), then SIGTERM: exit 0, no traceback, no process left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
from support.procs import LOOPBACK, Announcing, cmdline, descendants, listeners, reap  # noqa: E402
from support.serving import free_port  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COOLDOWN_S = 20.0  # --scale-up-cooldown
# Ray 2.60 starts each Serve replica's inter-deployment gRPC server on [::]:0 (ray/serve/_private/replica.py,
# hard-coded): the one listener not on loopback, and not ours to move.
RAY_REPLICA_GRPC = "ray::ServeReplica"


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.timeout(420)
def test_serve_ray_end_to_end() -> None:
    from openai import OpenAI

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).parent / "splitserve"
    cmd = [str(exe), "serve-ray", "-f", str(ROOT / "deploy/examples/local-cpu.yaml"), "--port", str(port),
           "--num-cpus", "2", "--kv-transport", "tcp", "--autoscale", "--autoscale-interval", "2",
           "--scale-up-cooldown", str(COOLDOWN_S), "--slo-itl", "0.1", "--max-prefill", "1", "--max-decode", "2"]
    # Ray kills workers past 95% of the host's memory, others' processes included: not on a shared test box
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_memory_monitor_refresh_ms="0")
    serve_ray = Announcing(cmd, env)
    proc = serve_ray.proc
    seen: set[int] = set()
    try:
        serve_ray.wait_for("splitserve ready", 240)
        seen |= descendants(proc.pid)

        # every socket on loopback (but Ray's own replica gRPC servers)
        for pid, addr, what in listeners(seen):
            assert addr in LOOPBACK or (RAY_REPLICA_GRPC in what and addr.strip("0") == ""), (pid, addr, what)

        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        def ask(max_tokens: int = 8) -> str:
            stream = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=max_tokens, temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        # a load step from idle (no request before it): the law, as Serve's application policy, asks for one
        # more worker within its cooldown; every streamed answer has text
        def replicas() -> set[int]:
            return {p for p in descendants(proc.pid) if "ServeReplica:local-cpu:decode" in cmdline(p)
                    or "ServeReplica:local-cpu:prefill" in cmdline(p)}

        start = replicas()
        stop_at = time.monotonic() + COOLDOWN_S + 10
        added_after = None
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            def load() -> None:
                while time.monotonic() < stop_at and added_after is None:
                    assert ask(32).strip()

            futures = [pool.submit(load) for _ in range(8)]
            while time.monotonic() < stop_at and added_after is None:
                if replicas() - start:
                    added_after = time.monotonic() - t0
                time.sleep(0.5)
            for f in futures:
                f.result()
        assert added_after is not None and added_after <= COOLDOWN_S, added_after
        seen |= descendants(proc.pid)

        # a killed prefill replica is replaced; meanwhile decode prefills locally and requests succeed
        before = {w["name"] for w in health(url)["workers"]}
        replica = next(p for p in descendants(proc.pid) if "ServeReplica:local-cpu:prefill" in cmdline(p))
        os.kill(replica, signal.SIGKILL)
        deadline = time.monotonic() + 90
        replaced = False
        while time.monotonic() < deadline and not replaced:
            assert ask(4).strip()
            h = health(url)
            replaced = any(w["role"] == "prefill" and w["name"] not in before and w["healthy"] for w in h["workers"])
            time.sleep(1.0)
        assert replaced, (f"no healthy new prefill worker 90 s after the kill: {json.dumps(health(url)['workers'])}"
                          f"\n{serve_ray.tail()}")
        seen |= descendants(proc.pid)
    finally:
        seen |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        left = reap(seen)
    assert code == 0, serve_ray.tail()
    assert "Traceback" not in "".join(serve_ray.stderr), "".join(serve_ray.stderr)
    assert not left, left
