"""The one configuration model from the outside: the example file runs, broken copies of it are one clear line
naming the field (exit 2), flags override the file and are named in their errors, and `splitserve schema`
prints a JSON Schema that validates the example and refuses the broken copies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
import yaml
from support.serving import Up

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "local-cpu.yaml"
BIN = Path(sys.executable).parent / "splitserve"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout)


def broken_copy(tmp_path: Path, edit) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    edit(doc)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


BROKEN = [
    ("unknown key", lambda d: d["spec"]["decode"].update(replicaz=2), "spec.decode.replicaz: unknown key"),
    ("wrong type", lambda d: d["spec"]["router"].update(port="eighty"), "spec.router.port: must be a valid integer"),
    ("negative count", lambda d: d["spec"]["prefill"].update(replicas=-1),
     "spec.prefill.replicas: must be greater than or equal to 0"),
]


@pytest.mark.parametrize("name,edit,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_file_is_one_line_naming_the_field(tmp_path, name, edit, message):
    path = broken_copy(tmp_path, edit)
    for command in (["up", "-f", str(path)], ["worker", "--config", str(path), "--role", "decode"]):
        res = run(*command)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and str(path) in lines[0], res.stderr
        assert "Traceback" not in res.stderr


def test_schema_validates_the_example_and_refuses_broken_copies(tmp_path):
    res = run("schema")
    assert res.returncode == 0
    schema = json.loads(res.stdout)
    assert "$ref" not in res.stdout  # inlined: a CRD's openAPIV3Schema takes no references
    jsonschema.validate(yaml.safe_load(EXAMPLE.read_text()), schema)
    for _, edit, _ in BROKEN:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(yaml.safe_load(broken_copy(tmp_path, edit).read_text()), schema)
    spec = schema["properties"]["spec"]["properties"]
    assert spec["router"]["properties"]["policy"]["description"] == "How a request's workers are chosen."


def test_a_bad_flag_names_the_flag():
    for args, flag in ((["up", "--prefill", "-1"], "--prefill"), (["up", "-f", str(EXAMPLE), "--port", "0"], "--port"),
                       (["up", "--decode", "0"], "--decode"), (["worker", "--kv-cache-memory", "lots"],
                                                               "--kv-cache-memory")):
        res = run(*args)
        assert res.returncode == 2 and res.stderr.startswith(f"splitserve: error: {flag}:"), res.stderr
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_prefill_workers_in_colocated_mode_are_an_error_not_ignored(tmp_path):
    """`up --mode colocated --prefill 1` would start no prefill worker: one line naming the flag, exit 2. A file
    may leave prefill.replicas at its default (what an API server fills in), not ask for more."""
    for args in (["--mode", "colocated", "--prefill", "1"], ["--mode", "colocated", "--prefill", "2"]):
        res = run("up", *args, "--dry-run")
        assert res.returncode == 2 and res.stderr.startswith("splitserve: error: --prefill: colocated mode"), \
            res.stderr
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    path = broken_copy(tmp_path, lambda d: d["spec"].update(mode="colocated", prefill={"replicas": 2}))
    res = run("up", "-f", str(path), "--dry-run")
    assert res.returncode == 2 and f"{path}: spec.prefill.replicas: colocated mode" in res.stderr, res.stderr
    for args in (["--mode", "colocated"], ["--mode", "colocated", "--prefill", "0"], ["--prefill", "2"],
                 ["-f", str(broken_copy(tmp_path, lambda d: d["spec"].update(mode="colocated")))]):
        assert run("up", *args, "--dry-run").returncode == 0, args


def test_an_unreadable_or_non_yaml_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed\n")
    for path, words in ((tmp_path / "missing.yaml", "cannot read"), (bad, "not valid YAML")):
        res = run("up", "-f", str(path))
        assert res.returncode == 2 and words in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_flags_are_generated_from_the_model():
    """Each config flag's help is its field's docstring, so nothing is documented twice."""
    from splitserve.cli import UP_FLAGS, WORKER_FLAGS
    from splitserve.common.config_file import spec_field

    res = run("up", "--help")
    text = " ".join(res.stdout.split())
    for f in UP_FLAGS + WORKER_FLAGS:
        for path in f.paths:
            spec_field(path)  # every flag names a real field
    _, field = spec_field("kv_transfer.backend")
    assert field.description.rstrip(".") in text


def test_up_serves_the_example_file():
    """...and disaggregates: a short chat and a burst of conversation-sized prompts (12 x 1000 tokens, twice what the
    README's trace replay sends; more than 512 MiB of SmolLM2 KV holds) all go to the prefill worker: none is
    prefilled on the decode worker for want of KV blocks or for being short. (A transfer that times out on a
    loaded box falls back to a local prefill; that is not what this checks.)"""
    import random
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from support.serving import metric_sum

    up = Up("-f", str(EXAMPLE))
    try:
        c = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4)
        assert r.usage.completion_tokens > 0
        assert len(up.components["prefill"]) == 1 and len(up.components["decode"]) == 1
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 30000) for _ in range(1000)] for _ in range(12)]

        def one(prompt: list[int]) -> int:
            return httpx.post(up.url + "/v1/completions", json={"model": "smollm2", "prompt": prompt,
                                                                "max_tokens": 4}, timeout=300).status_code

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(one, prompts)) == [200] * len(prompts)
        m = up.metrics("decode")
        local = {k: v for k, v in m.items() if k.startswith("splitserve_local_prefill_total") and v
                 and 'reason="fallback"' not in k}
        remote = metric_sum(m, "splitserve_remote_prefill_total")  # ok or failed (then a fallback)
        assert local == {} and remote == 1 + len(prompts), m
    finally:
        assert up.stop() == 0


def test_a_worker_whose_port_is_taken_says_so_and_exits():
    """A port held by another process: the worker exits 2 naming the flag, instead of serving without its metrics
    (uvicorn ends its thread) or sharing its gRPC port with the other process (SO_REUSEPORT)."""
    import socket

    for flag in ("--port", "--metrics-port"):
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                free = str(s.getsockname()[1])
            ports = {"--port": free, "--metrics-port": free} | {flag: str(port)}
            res = run("worker", "--config", str(EXAMPLE), "--role", "decode", *[x for kv in ports.items() for x in kv])
        assert res.returncode == 2, res.stderr[-2000:]
        line = [x for x in res.stderr.splitlines() if x.startswith("splitserve: error:")]
        assert len(line) == 1 and line[0].startswith(f"splitserve: error: {flag}: cannot listen on 127.0.0.1:{port} "
                                                     "(in use?)"), res.stderr[-2000:]
        assert "Traceback" not in res.stderr
