"""`engine: vllm` from the command line and in fresh interpreters: what vLLM cannot honour is one line naming the
flag or field, the block size defaults and overrides, and the NIXL pacing plugin is inert unless asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from unit.vllm_engine.test_engine_config import cluster

from splitserve.common.config import ClusterResource
from splitserve.common.config_file import load

pytestmark = pytest.mark.slow


BIN = Path(sys.executable).parent / "splitserve"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["worker", "--engine", "vllm", "--device", "cpu", "--block-size", "16"],
     "--block-size: vLLM on CPU needs 32-token KV blocks"),
    (["up", "--engine", "nope", "--dry-run"], "--engine"),
    (["worker", "--vllm-url", "http://127.0.0.1:1"], "--vllm-url: this worker's engine is native"),
])
def test_what_vllm_cannot_honour_is_one_line_naming_the_flag(args, message):
    res = run(*args)
    assert res.returncode == 2, res.stdout
    assert res.stderr.startswith("splitserve: error: ") and message in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


@pytest.mark.parametrize("spec,message", [
    ({"engine": "vllm", "model": {"device": "cpu"}, "prefill": {"engine": {"kind": "native"}}},
     "prefill.engine.kind: prefill workers run native and decode workers vllm"),
    ({"engine": "vllm", "decode": {"engine": {"threads": 2}}}, "decode.engine.threads: engine vllm"),
    ({"engine": "vllm", "kvPool": {"enabled": True}, "model": {"tensorParallelSize": 2}},
     "model.tensorParallelSize: the KV pool stores unsharded blocks only"),
    ({"engine": "vllm", "vllm": {"args": ["--port", "9"]}}, "--port is set by splitserve"),
    ({"engine": "vllm", "decode": {"engine": {"vllmArgs": ["--kv-transfer-config={}"]}}},
     "--kv-transfer-config is set by splitserve"),
    ({"vllm": {"args": ["--ok", "bad\narg"]}}, "not a plain argument"),
    ({"decode": {"engine": {"dataParallelSize": 2}}}, "decode.engine.dataParallelSize: engine native runs one engine"),
    ({"engine": "vllm", "vllm": {"args": ["--data-parallel-size=2"]}}, "--data-parallel-size is set by splitserve"),
    ({"engine": "vllm", "model": {"device": "cpu"}, "decode": {"engine": {"batchInvariant": True}}},
     "decode.engine.batchInvariant: vLLM's batch-invariant mode runs on GPUs only"),
])
def test_a_file_vllm_cannot_honour_is_one_line_naming_the_field(tmp_path, spec, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "splitserve.dev/v1alpha1", "kind": "SplitServeCluster",
                                    "metadata": {"name": "t"}, "spec": spec}))
    res = run("up", "-f", str(path), "--dry-run")
    assert res.returncode == 2 and message in res.stderr and str(path) in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_engine_vllm_defaults_to_32_token_blocks_and_a_role_may_override_the_engine():
    r = load(None, {"engine": "vllm"}, {})
    assert r.spec.model.block_size == 32 and r.spec.engine_of("prefill") == r.spec.engine_of("decode") == "vllm"
    assert load(None, {}, {}).spec.model.block_size == 16  # native keeps its own default
    mixed = cluster(mode="colocated", decode={"engine": {"kind": "vllm"}})
    assert mixed.spec.engine == "native" and mixed.spec.engine_of("both") == "vllm"
    # the dry run prints a document that validates again to the same thing (a worker reads it back)
    res = run("up", "--engine", "vllm", "--mode", "colocated", "--decode", "2", "--dry-run")
    assert res.returncode == 0, res.stderr
    again = ClusterResource.model_validate(yaml.safe_load(res.stdout))
    assert again.spec.engine == "vllm" and again.spec.model.block_size == 32


def test_the_nixl_pacing_plugin_is_inert_unless_asked():
    """Against the installed NIXL, in fresh interpreters: with the variable, an agent configuration's progress
    delay (which NIXL's agent sets to 0) stays at the asked minimum; without it, nothing is patched."""
    probe = ("from splitserve.vllm_engine.in_vllm.vllm_plugin import register\nregister()\nimport nixl._api as a\n"
             "c = a.nixlBind.nixlAgentConfig()\nc.pthrDelay = 0\nprint(c.pthrDelay)\n")
    import os

    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_NIXL_PROGRESS_DELAY_US"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**env, "SPLITSERVE_NIXL_PROGRESS_DELAY_US": "1000"})
    if "No module named 'nixl" in out.stderr:
        pytest.skip("NIXL is not installed here (the Makefile installs it; the tcp transport works without)")
    assert out.returncode == 0 and out.stdout.strip() == "1000", out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr[-2000:]
