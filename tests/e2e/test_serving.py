"""Disaggregated serving end to end: `splitserve up` as real processes, real gRPC, real SmolLM2 weights, the
official `openai` client against the gateway.

The disaggregated instance runs with --disagg-threshold 32 so chat prompts (the template alone is ~30 tokens)
take the remote-prefill path on this CPU, while one-word completions stay local.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
from support.helpers import greedy, make_engine
from support.serving import Up, metric_sum

pytestmark = pytest.mark.slow

# Each question alone is over 32 tokens, so the uncached part of the prompt stays above the threshold even
# when the decode worker already holds the chat template's system prompt in its prefix cache.
QUESTIONS = [
    "I am planning a trip to Europe next spring and want to see the main sights. What is the capital of France, "
    "and what is one famous landmark there that every first-time visitor should see?",
    "Give me three practical tips for staying focused while studying for exams in a noisy shared apartment, "
    "with roommates who often play loud music late into the evening.",
    "Write a short haiku about the sea at dawn, when the fishing boats are leaving the harbour and the gulls are "
    "circling over the grey water.",
    "Explain what a prime number is to a curious seven year old child who likes counting sweets and sharing them "
    "equally between friends at school.",
]


@pytest.fixture(scope="module")
def disagg():
    up = Up("--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--disagg-threshold", "32")
    yield up
    assert up.stop() == 0


@pytest.fixture(scope="module")
def colocated(colocated_one):
    return colocated_one  # the e2e tests' colocated cluster (tests/e2e/conftest.py): this module only reads from it


def client(up: Up) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def bare(smollm2_dir):
    """Greedy outputs of the bare engine (same weights, in process) for QUESTIONS."""
    engine = make_engine(smollm2_dir)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [r["text"] for r in engine.generate(prompts, greedy(24))]


def chat_text(up: Up, q: str, **kw) -> str:
    r = client(up).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                           max_tokens=24, temperature=0, **kw)
    return r.choices[0].message.content


def test_models_chat_stream_and_completions(disagg):
    c = client(disagg)
    assert [m.id for m in c.models.list().data] == ["smollm2"]
    r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is 2+2?"}],
                                  max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.prompt_tokens > 20 and 0 < r.usage.completion_tokens <= 16
    chunks = list(c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and chunks[-1].usage.completion_tokens > 0
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    comp = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 8
    ids = c.completions.create(model="smollm2", prompt=[504, 3575, 282], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3
    lp = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   temperature=0, logprobs=True, top_logprobs=2)
    entries = lp.choices[0].logprobs.content
    assert len(entries) == lp.usage.completion_tokens and len(entries[0].top_logprobs) == 2
    assert entries[0].logprob <= 0 and entries[0].top_logprobs[0].logprob >= entries[0].top_logprobs[1].logprob


def test_greedy_identical_disaggregated_colocated_bare(disagg, colocated, bare):
    before = disagg.metrics("prefill")
    dec_before = disagg.metrics("decode")
    for q, expected in zip(QUESTIONS, bare, strict=True):
        assert chat_text(disagg, q) == expected
        assert chat_text(colocated, q) == expected
    after = disagg.metrics("prefill")
    dec_after = disagg.metrics("decode")
    # the KV really crossed: the prefill worker sent bytes and the decode worker prefilled nothing itself
    sent = metric_sum(after, "splitserve_kv_transfer_bytes_total", direction="send") - \
        metric_sum(before, "splitserve_kv_transfer_bytes_total", direction="send")
    received = metric_sum(dec_after, "splitserve_kv_transfer_bytes_total", direction="recv") - \
        metric_sum(dec_before, "splitserve_kv_transfer_bytes_total", direction="recv")
    assert sent > 0 and received > 0
    assert metric_sum(dec_after, "splitserve_local_prefill_total") == metric_sum(dec_before, "splitserve_local_prefill_total")
    assert metric_sum(dec_after, "splitserve_remote_prefill_total", outcome="ok") - \
        metric_sum(dec_before, "splitserve_remote_prefill_total", outcome="ok") == len(QUESTIONS)
    # colocated workers never transfer
    assert metric_sum(colocated.metrics("decode"), "splitserve_kv_transfer_bytes_total") == 0


def test_short_prompt_prefills_locally(disagg):
    before = metric_sum(disagg.metrics("decode"), "splitserve_local_prefill_total", reason="short_prompt")
    client(disagg).completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0)
    after = metric_sum(disagg.metrics("decode"), "splitserve_local_prefill_total", reason="short_prompt")
    assert after == before + 1


def test_32_concurrent_streams_complete_correctly(disagg, bare):
    async def one(c, i):
        q = QUESTIONS[i % len(QUESTIONS)]
        stream = await c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                                 max_tokens=24, temperature=0, stream=True)
        text, finish = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        return i, text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=disagg.url + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for i, text, finish in results:
        assert finish in ("stop", "length")
        assert text == bare[i % len(QUESTIONS)]


def test_bench_against_the_gateway(disagg, tmp_path):
    """`splitserve bench` in Poisson and trace-replay modes (the trace samples the repository carries) ends with
    the contract's JSON line; the README's two examples, sized for this CPU, complete every request."""
    import sys
    from pathlib import Path

    from e2e.test_cli import readme_commands

    root = Path(__file__).resolve().parents[2]
    exe = str(Path(sys.executable).parent / "splitserve")
    runs = [["--rate", "0", "--num-requests", "4", "--input-len", "48", "--output-len", "6"]]
    for trace in sorted((root / "benchmarks" / "traces").glob("*_48.*")):
        runs.append(["--trace", str(trace), "--num-requests", "3", "--time-scale", "0.01", "--max-input-len", "96",
                     "--max-output-len", "6"])
    readme = [[a for a in c[1:] if a != "--json"] for c in readme_commands() if c[0] == "bench"]
    assert len(readme) == 2 and all(c[:2] == ["-f", "deploy/examples/local-cpu.yaml"] for c in readme), readme
    runs += readme
    for extra in runs:
        res = subprocess.run([exe, "bench", "--url", disagg.url, "--model", "smollm2", "--json", "--no-progress", *extra],
                             capture_output=True, text=True, timeout=300, cwd=root)
        assert res.returncode == 0, res.stderr[-1000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        for key in ("requests", "completed", "failed", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                    "output_tok_s", "goodput_rps"):
            assert key in out, key
        assert out["completed"] == out["requests"] and out["failed"] == 0
        assert out["output_tok_s"] > 0 and out["ttft_p50_s"] > 0
        if extra in readme:  # judged by the cluster file's own SLO (4 s TTFT, 0.5 s ITL)
            assert (out["slo_ttft_s"], out["slo_itl_s"]) == (4.0, 0.5), out
        if extra is readme[0]:  # short Poisson prompts: this CPU meets that SLO even when busy
            assert out["goodput_rps"] > 0, out


BAD = [
    ("invalid json", b"{not json", 400, None),
    ("wrong type", {"model": "smollm2", "messages": "hi"}, 400, "messages"),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("negative max_tokens", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
     400, "max_tokens"),
    ("huge max_tokens", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9},
     400, "max_tokens"),
    ("unsupported field", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "tools": []},
     400, "tools"),
    ("n > 1", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("bad temperature", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     400, "temperature"),
    ("unknown field", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
     400, "frobnicate"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_service_keeps_serving(disagg, name, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(disagg.url + "/v1/chat/completions", content=content,
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param
    assert httpx.get(disagg.url + "/health", timeout=10).status_code == 200


def test_prompt_over_context_length(disagg):
    r = httpx.post(disagg.url + "/v1/completions", json={"model": "smollm2", "prompt": [100] * 9000, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client(disagg).completions.create(model="smollm2", prompt="still serving", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_client_disconnect_frees_blocks_on_both_workers(disagg):
    def settled():
        d, p = disagg.stats("decode"), disagg.stats("prefill")
        return d["num_running"] == 0 and d["kv_blocks_used"] == 0 and p["kv_blocks_used"] == 0 and p["num_held"] == 0

    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", disagg.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if len(lines) >= 5:
                during = disagg.stats("decode")  # still reading: the request is decoding
                break  # leaving the iterator closes the connection: the client is gone
    assert during["num_running"] + during["num_waiting"] == 1 and during["kv_blocks_used"] > 0, (during, lines)
    for _ in range(100):
        if settled():
            break
        time.sleep(0.1)
    assert settled(), (disagg.stats("decode"), disagg.stats("prefill"))


def test_prefill_worker_killed_mid_flight_every_request_completes():
    up = Up("--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--disagg-threshold", "32",
            "--kv-transport", "tcp")
    try:
        pid = up.components["prefill"][0]["pid"]

        async def one(c, i):
            q = f"{QUESTIONS[i % len(QUESTIONS)]} Answer number {i}."
            r = await c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                                max_tokens=16, temperature=0)
            return r.choices[0].message.content, r.choices[0].finish_reason

        async def main():
            async with openai.AsyncOpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
                tasks = [asyncio.ensure_future(one(c, i)) for i in range(8)]
                await asyncio.sleep(0.3)
                os.kill(pid, signal.SIGKILL)
                tasks += [asyncio.ensure_future(one(c, i)) for i in range(8, 12)]
                return await asyncio.wait_for(asyncio.gather(*tasks), 300)

        results = asyncio.run(main())
        assert len(results) == 12 and all(text and finish in ("stop", "length") for text, finish in results)
        m = up.metrics("decode")
        assert metric_sum(m, "splitserve_local_prefill_total", reason="fallback") + \
            metric_sum(m, "splitserve_local_prefill_total", reason="no_prefill_worker") >= 1
        assert up.stats("decode")["kv_blocks_used"] == 0
    finally:
        assert up.stop() == 0
