"""engine vllm, colocated, end to end: `splitserve up --engine vllm --mode colocated --decode 2 --routing
kv_aware` (two real vLLM CPU servers, a bundled Redis). vLLM's KV events become our chained block hashes in
Redis, the gateway's index names the worker holding a prompt's blocks, and kv_aware sends a prompt sharing
that prefix to it (vLLM itself reports the prefix cache hit)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import httpx
import pytest
from support.serving import Up, metric_sum, scrape, vllm_server_of

pytestmark = pytest.mark.slow

PREFIX = ("You are a careful assistant for a railway company. Answer questions about timetables, tickets, "
          "refunds, bicycles on trains, seat reservations, delays and connections in short, polite sentences. "
          "Never invent a timetable; say when you do not know. ") * 3


@pytest.fixture(scope="module")
def colo():
    up = Up("--engine", "vllm", "--mode", "colocated", "--decode", "2", "--routing", "kv_aware", timeout=900)
    yield up
    assert up.stop() == 0


def health(up: Up) -> dict:
    with urllib.request.urlopen(up.url + "/health", timeout=10) as r:
        return json.loads(r.read())


def complete(up: Up, prompt: str) -> dict:
    r = httpx.post(up.url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 4,
                                                     "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_both_workers_are_vllm_and_healthy(colo):
    h = health(colo)
    assert [w["engine"] for w in h["workers"]] == ["vllm", "vllm"]
    assert all(w["capabilities"] == ["resume"] for w in h["workers"]), h["workers"]
    assert h["all_healthy"] and h["policy"] == "kv_aware"


def test_kv_aware_routes_a_shared_prefix_to_the_worker_holding_it(colo):
    complete(colo, PREFIX + "Question 0: can I take my bicycle on the morning train?")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = {w["name"]: w["indexed_blocks"] for w in health(colo)["workers"]}
        if any(held.values()):
            break
        time.sleep(0.5)
    holder = max(held, key=held.get)
    assert held[holder] >= 4 and sorted(held.values())[0] == 0, held  # ~290 prompt tokens: >= 4 blocks of 32
    for i in range(1, 5):
        r = complete(colo, PREFIX + f"Question {i}: what happens to my ticket when the train is late?")
        cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert cached >= 4 * 32, r["usage"]  # vLLM found the prefix in its cache: it ran where the blocks are
    held = {w["name"]: w["indexed_blocks"] for w in health(colo)["workers"]}
    assert sorted(held.values())[0] == 0, held  # nothing of it went to the other worker


def stream_text(up: Up, body: dict, then=None) -> tuple[str, str | None]:
    """A streamed completion's text and finish_reason; `then()` runs once after its fourth text chunk."""
    text, finish, chunks = "", None, 0
    with httpx.stream("POST", up.url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                chunks += bool(choice["text"])
            if chunks == 4 and then is not None:
                then()
    return text, finish


def test_a_stream_whose_vllm_server_dies_moves_to_the_other_worker(colo):
    """SIGKILL the vLLM server under a greedy stream (last: it takes a worker away): the sidecar marks the
    failure retryable, the gateway moves the stream to the other worker, which continues after the tokens
    already sent, and the client's text is the undisturbed one."""
    body = {"model": "smollm2", "prompt": "The history of the railway in three sentences:", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    undisturbed = stream_text(colo, body)

    def kill() -> None:
        busy = max(health(colo)["workers"], key=lambda w: w["outstanding"])
        worker = next(c for c in colo.components["decode"] if c["grpc"] == busy["endpoint"])
        os.killpg(os.getpgid(vllm_server_of(worker["pid"])[0]), signal.SIGKILL)  # the server, its engine processes

    moved = stream_text(colo, body, then=kill)
    assert moved == undisturbed and moved[1] == "length"
    m = scrape(colo.url)
    assert metric_sum(m, "splitserve_router_migrations_total", outcome="resumed") >= 1, m
