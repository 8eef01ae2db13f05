"""The KV pool for engine vllm from the command line and from its copied files alone: `splitserve up --engine
vllm --kv-pool` is accepted, and the connector imports from the files `splitserve vllm-connector` copies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_up_with_engine_vllm_and_the_pool_is_accepted():
    res = subprocess.run([str(Path(sys.executable).parent / "splitserve"), "up", "--engine", "vllm", "--kv-pool",
                          "--dry-run"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "kvPool" in res.stdout, res.stderr


def test_the_connector_imports_from_its_copied_files_alone(tmp_path):
    """What the init container copies is enough: vLLM (installed here) imports the connectors (the pool's, the
    layerwise one) from the copy, with this checkout's splitserve and redis-py hidden."""
    res = subprocess.run([str(Path(sys.executable).parent / "splitserve"), "vllm-connector", str(tmp_path / "py")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith(str(tmp_path / "py")), res.stderr
    probe = f"""
import sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # this checkout's splitserve
sys.path = [{str(tmp_path / "py")!r}] + [p for p in sys.path if p]
import redis, splitserve.vllm_engine.in_vllm.pool_connector as c
import splitserve.vllm_engine.in_vllm.layerwise_connector as lw, splitserve.vllm_engine.in_vllm.layerwise_mover
assert lw.__file__.startswith({str(tmp_path / "py")!r}), lw.__file__
print(c.__file__, redis.__file__, c.SplitservePoolConnector.__name__)
"""
    res = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    connector, redis_file, name = res.stdout.split()
    assert connector.startswith(str(tmp_path / "py")) and redis_file.startswith(str(tmp_path / "py"))
    assert name == "SplitservePoolConnector"
    bad = subprocess.run([str(Path(sys.executable).parent / "splitserve"), "vllm-connector", "/proc/no/such"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "/proc/no/such" in bad.stderr, bad.stderr
