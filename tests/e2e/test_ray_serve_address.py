"""`splitserve serve-ray --address` on a Ray cluster someone else started (`ray start --head` on loopback, 2 CPUs,
no dashboard), with engine vllm: the decode replica hosts a splitserve worker whose child is a real vLLM CPU
server. The `openai` client streams an answer; the gateway lists a vllm worker; SIGTERM takes the application
down (exit 0, no traceback, the worker and its vLLM server gone) and leaves the cluster itself running, as it
should for a cluster serve-ray did not start; then the cluster is killed and nothing is left.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("vllm")
from support.procs import LOOPBACK, Announcing, alive, cmdline, descendants, listeners, module_of, reap  # noqa: E402

from splitserve.common.proc import free_ports  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY_REPLICA_GRPC = "ray::ServeReplica"  # Ray's replica gRPC servers bind [::]:0 (not ours to move)


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.timeout(600)
def test_serve_ray_on_an_existing_cluster_with_vllm_workers() -> None:
    from openai import OpenAI

    gcs, port = free_ports(2)
    # a short temp dir: Ray's Unix sockets live under it (108 bytes at most for a socket's path)
    tmp = Path(tempfile.mkdtemp(prefix="ssray-", dir="/tmp"))
    # the cluster asks for a token (Ray's default for a new cluster); serve-ray joins with it
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_memory_monitor_refresh_ms="0", RAY_DISABLE_FAILURE_SIGNAL_HANDLER="1", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(32))
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
         "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
         "--temp-dir", str(tmp / "ray")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    serve_ray = None
    seen: set[int] = set()
    try:
        serve_ray = Announcing(
            [str(BIN / "splitserve"), "serve-ray", "-f", str(ROOT / "deploy/examples/local-cpu.yaml"),
             "--address", f"127.0.0.1:{gcs}", "--port", str(port), "--engine", "vllm", "--mode", "colocated",
             "--decode", "1"], env)
        serve_ray.wait_for("splitserve ready", 420)
        url = f"http://127.0.0.1:{port}"
        seen = descendants(head.pid)
        workers = health(url)["workers"]
        assert [(w["role"], w["engine"], w["healthy"]) for w in workers] == [("both", "vllm", True)], workers
        servers = [p for p in seen if module_of(p) == "vllm.entrypoints.openai.api_server"]
        assert len(servers) == 1, [cmdline(p) for p in seen]
        for pid, addr, what in listeners(seen | descendants(serve_ray.proc.pid)):
            assert addr in LOOPBACK or (RAY_REPLICA_GRPC in what and addr.strip("0") == ""), (pid, addr, what)

        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

        # SIGTERM: the application goes (the worker drains, its vLLM server stops), the cluster stays
        # within the bound serve-ray sets itself: its wait for the application to go (the longest graceful
        # shutdown, drainSeconds + 10 s, and 30 s more; it logs every 15 s while it waits), then Ray's shutdown.
        # Here it takes seconds; once, in a full test run, it took over 120 s (a failure here now shows its log)
        serve_ray.proc.send_signal(signal.SIGTERM)
        assert serve_ray.exit_code(220) == 0, serve_ray.tail()
        assert "Traceback" not in "".join(serve_ray.stderr), "".join(serve_ray.stderr)
        left = reap(set(servers), wait_s=60)
        assert not left, left
        assert head.poll() is None, "serve-ray stopped a cluster it did not start"
    finally:
        seen |= descendants(head.pid)
        if serve_ray is not None and serve_ray.proc.poll() is None:
            serve_ray.proc.kill()
        # the cluster is ours to end: a kill, not `ray start --block`'s SIGTERM path (a second's grace for each
        # of its processes in turn, half a minute here); what it started outside its session follows its raylet
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:  # the cluster died on its own (the failure above says how): nothing to kill
            pass
        head.wait(30)
        left = reap(seen, wait_s=30)
        shutil.rmtree(tmp, ignore_errors=True)
    assert not left, left
    assert not any(alive(p) for p in seen)
