"""Trustworthy under load and at rest, with real processes: an idle cluster costs almost no CPU; an overloaded one
(with a CPU hog beside it) answers every request or says 429, never 503, never flaps, and leaks no KV block;
a huge request never stalls /health; SIGTERM stops everything cleanly; every way a request can end frees its
blocks on both workers."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml
from support.serving import Up, metric_sum

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "local-cpu.yaml"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its threads, in seconds (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def cluster_file(tmp_path: Path, **spec) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for dotted, value in spec.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def pids(up: Up) -> dict[str, int]:
    out = {"router": up.components["router_pid"]}
    for role in ("prefill", "decode"):
        for i, c in enumerate(up.components[role]):
            out[f"{role}-{i}"] = c["pid"]
    return out


def blocks_settled(up: Up) -> bool:
    for role in ("prefill", "decode"):
        for i in range(len(up.components[role])):
            s = up.stats(role, i)
            if s["kv_blocks_used"] or s["num_held"] or s["num_running"] or s["num_waiting"] \
                    or s["num_waiting_remote_kv"]:
                return False
    return True


def wait_settled(up: Up, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if blocks_settled(up):
            return True
        time.sleep(0.2)
    return False


def no_errors_logged(up: Up) -> None:
    text = "".join(up.stderr)
    assert "Traceback" not in text and "never retrieved" not in text, text[-3000:]


def test_overload_with_a_cpu_hog_no_503_no_flaps_no_leaks(tmp_path):
    # 6 in flight + 6 queued: the other 36 of the 48 must be refused with 429 at once (admission), not 503
    path = cluster_file(tmp_path, **{"router.maxInflight": 6, "router.maxQueue": 6})
    up = Up("-f", str(path))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 30000) for _ in range(300)] for _ in range(48)]

        async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
            r = await client.post(up.url + "/v1/completions", json={"model": "smollm2", "prompt": prompt,
                                                                   "max_tokens": 8, "temperature": 0})
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 8
            return r.status_code

        async def main() -> list[int]:
            async with httpx.AsyncClient(timeout=900) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        statuses = asyncio.run(main())
        assert set(statuses) <= {200, 429} and statuses.count(200) >= 12, statuses
        with urllib.request.urlopen(up.url + "/metrics", timeout=10) as r:
            gateway = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                       for line in r.read().decode().splitlines() if line and not line.startswith("#")}
        assert metric_sum(gateway, "splitserve_health_flaps_total") == 0
        for role in ("prefill", "decode"):
            assert metric_sum(up.metrics(role), "splitserve_worker_health_flaps_total") == 0
    finally:
        hog.kill()
        hog.wait()
    try:
        assert wait_settled(up), (up.stats("prefill"), up.stats("decode"))
        no_errors_logged(up)
    finally:
        assert up.stop() == 0


def test_a_huge_request_never_stalls_health(colocated_one):
    up = colocated_one  # the e2e tests' colocated cluster (tests/e2e/conftest.py): what it is sent is refused
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get(up.url + "/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.02)

    t = threading.Thread(target=probe)
    t.start()
    try:
        time.sleep(0.5)
        huge = "word " * ((11 << 20) // 5)  # ~11 MB of prompt text: within the body limit
        r = httpx.post(up.url + "/v1/completions", json={"model": "smollm2", "prompt": huge, "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        over = b'{"model": "smollm2", "prompt": "' + b"x" * (17 << 20) + b'"}'
        r = httpx.post(up.url + "/v1/completions", content=over, headers={"Content-Type": "application/json"},
                       timeout=60)
        assert r.status_code == 413
        time.sleep(0.3)
    finally:
        stop.set()
        t.join()
    # parsing or tokenizing 11 MB on the event loop would stall /health for seconds; 0.3 s leaves room for a
    # busy machine's scheduling hiccups
    assert len(latencies) > 10 and max(latencies) < 0.3, sorted(latencies)[-5:]


def test_sigterm_stops_everything_even_a_child_that_ignores_it(tmp_path):
    path = cluster_file(tmp_path, **{"prefill.drainSeconds": 2, "decode.drainSeconds": 2})
    up = Up("-f", str(path))
    stuck = up.components["prefill"][0]["pid"]
    os.kill(stuck, signal.SIGSTOP)  # a child that cannot act on SIGTERM
    t0 = time.monotonic()
    code = up.stop()
    assert code == 0 and time.monotonic() - t0 < 40
    assert not Path(f"/proc/{stuck}").exists() or "zombie" in Path(f"/proc/{stuck}/status").read_text()
    for pid in pids(up).values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    no_errors_logged(up)


def test_an_idle_worker_exits_within_seconds_and_a_busy_one_drains(tmp_path):
    path = cluster_file(tmp_path, **{"decode.replicas": 2, "decode.drainSeconds": 60})
    up = Up("-f", str(path), "--mode", "colocated")
    try:
        idle = up.components["decode"][1]["pid"]
        busy = up.components["decode"][0]["pid"]
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": True}
        # both workers are idle: route a streaming request and find which worker runs it
        with httpx.stream("POST", up.url + "/v1/completions", json=body, timeout=120) as r:
            lines = iter(r.iter_lines())
            next(line for line in lines if line.startswith("data: "))
            running = [i for i in (0, 1) if up.stats("decode", i)["num_running"]]
            assert len(running) == 1
            busy = up.components["decode"][running[0]]["pid"]
            idle = up.components["decode"][1 - running[0]]["pid"]
            t0 = time.monotonic()
            os.kill(idle, signal.SIGTERM)
            os.kill(busy, signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1] if json.loads(x[6:])["choices"]]
        assert finish[-1] == "length"  # the busy worker finished the request it had
        for pid, limit in ((idle, 10), (busy, 60)):
            while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text():
                assert time.monotonic() - t0 < limit, f"worker {pid} still running"
                time.sleep(0.1)
    finally:
        up.stop()


def test_a_transfer_deadline_frees_blocks_on_both_workers(tmp_path):
    """The decode worker gives up on a remote prefill at its deadline, prefills locally, and afterwards neither
    worker holds a block."""
    path = cluster_file(tmp_path, **{"kvTransfer.timeoutSeconds": 0.2, "decode.disaggThreshold": 32,
                                    "kvTransfer.backend": "tcp"})
    up = Up("-f", str(path))
    try:
        rng = random.Random(1)
        for _ in range(2):  # a 1000-token prefill takes seconds here: far past the 0.2 s deadline
            prompt = [rng.randrange(1000, 30000) for _ in range(1000)]
            r = httpx.post(up.url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 4},
                           timeout=300)
            assert r.status_code == 200, r.text
        m = up.metrics("decode")
        assert metric_sum(m, "splitserve_local_prefill_total", reason="fallback") >= 1
        assert wait_settled(up), (up.stats("prefill"), up.stats("decode"))
        no_errors_logged(up)
    finally:
        assert up.stop() == 0


@pytest.fixture(scope="module")
def cluster():
    up = Up("--disagg-threshold", "512")
    yield up
    assert up.stop() == 0


def test_an_idle_cluster_uses_under_3_percent_of_a_core_per_process(cluster):
    """NIXL is used when installed (the default transport picks it), TCP otherwise. The module's cluster, before
    any request: nothing has run on it yet."""
    up = cluster
    time.sleep(3)  # let start-up work settle
    procs = pids(up)
    before = {name: cpu_seconds(pid) for name, pid in procs.items()}
    t0 = time.monotonic()
    time.sleep(20)
    elapsed = time.monotonic() - t0
    usage = {name: (cpu_seconds(pid) - before[name]) / elapsed for name, pid in procs.items()}
    assert all(u < 0.03 for u in usage.values()), usage


def test_finished_and_aborted_requests_free_their_blocks(cluster):
    up = cluster
    c = httpx.Client(timeout=120)
    r = c.post(up.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hello there", "max_tokens": 4})
    assert r.status_code == 200
    with c.stream("POST", up.url + "/v1/completions", json={"model": "smollm2", "prompt": "Tell a story",
                                                           "max_tokens": 500, "ignore_eos": True, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                break  # leave mid-stream: the request is aborted
    assert wait_settled(up)


def test_small_things(cluster, tmp_path):
    up = cluster
    c = httpx.Client(timeout=120)
    # a non-JSON body is refused by type
    r = c.post(up.url + "/v1/completions", content=b"hello", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    # text_offset is filled and consistent with the tokens
    r = c.post(up.url + "/v1/completions", json={"model": "smollm2", "prompt": "The capital of France is",
                                                 "max_tokens": 6, "logprobs": 1, "temperature": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["text_offset"]) == len(lp["tokens"]) == 6
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"], strict=False))
    # cached tokens are reported: the same prompt twice hits the prefix cache
    body = {"model": "smollm2", "prompt": "word " * 80, "max_tokens": 1}
    c.post(up.url + "/v1/completions", json=body)
    usage = c.post(up.url + "/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 64
    # chat log-probabilities carry each token's own bytes
    r = c.post(up.url + "/v1/chat/completions", json={"model": "smollm2", "max_tokens": 5, "logprobs": True,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
    from splitserve.common.text import Tokenizer
    from splitserve.engine.model_files import prepare_model

    tok = Tokenizer(prepare_model("smollm2"))
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        ids = tok.encode(entry["token"], add_special_tokens=False)
        if len(ids) == 1 and "\ufffd" not in entry["token"]:
            assert bytes(entry["bytes"]) == tok.token_bytes(ids[0]) == entry["token"].encode()
    # the gateway exports only its own metrics
    text = c.get(up.url + "/metrics").text
    for foreign in ("splitserve_worker_running_requests", "splitserve_worker_kv_blocks", "splitserve_worker_requests",
                    "splitserve_kv_transfer", "splitserve_local_prefill"):
        assert foreign not in text
    assert "splitserve_health_flaps_total" in text and "splitserve_worker_health_flaps_total" in c.get(
        up.components["decode"][0]["metrics"] + "/metrics").text


def test_token_bytes_rebuild_multibyte_text():
    from splitserve.common.text import Tokenizer
    from splitserve.engine.model_files import prepare_model

    tok = Tokenizer(prepare_model("smollm2"))
    text = "naïve café — 中文 🙂 ꙮ𒀀 Ελληνικά"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == text
    assert any(p and not _valid_utf8(p) for p in pieces)  # some token is part of a character


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_generate_checks_max_tokens_against_the_context():
    exe = Path(sys.executable).parent / "splitserve"
    res = subprocess.run([str(exe), "generate", "--prompt", "hi", "--max-tokens", "99999"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("splitserve: error: --max-tokens")
    assert res.stderr.count("\n") == 1
