"""Seeded sampling with real processes: the same seed gives the same text colocated and prefill-then-decode
(`splitserve up`, SmolLM2 on this CPU)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from support.serving import Up, metric_sum

pytestmark = pytest.mark.slow


# -- colocated and disaggregated, real processes ---------------------------------------------------------
QUESTIONS = {  # seed -> a prompt; each long enough that its uncached part goes to the prefill worker
    7: "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night, and what "
       "the message says.",
    8: "Describe a journey by train across a snowy mountain range, as seen by a young child travelling alone to "
       "visit her grandmother.",
}


def _chat(up: Up, seed: int) -> str:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTIONS[seed]}], "max_tokens": 20,
            "temperature": 0.9, "top_p": 0.95, "seed": seed, "ignore_eos": True}
    req = urllib.request.Request(up.url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == 20
    return out["choices"][0]["message"]["content"]


def test_the_same_seed_gives_the_same_text_colocated_and_disaggregated(colocated_one):
    up = colocated_one
    colocated = {seed: _chat(up, seed) for seed in (7, 8)}
    assert _chat(up, 7) == colocated[7]  # again, its prompt cached this time
    up = Up("--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--disagg-threshold", "32")
    try:
        disaggregated = {seed: _chat(up, seed) for seed in (7, 8)}
        decode = up.metrics("decode")
        assert metric_sum(decode, "splitserve_remote_prefill_total", outcome="ok") == 2
        assert metric_sum(decode, "splitserve_local_prefill_total") == 0
    finally:
        assert up.stop() == 0
    assert disaggregated == colocated
