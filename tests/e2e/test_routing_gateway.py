"""Routing through a real gateway in front of two real colocated workers, read from the per-reason decision
counter and each worker's own request counter."""

from __future__ import annotations

import asyncio
import urllib.request

import openai
import pytest
from support.serving import Up, metric_sum

pytestmark = pytest.mark.slow


def _worker_requests(up: Up, i: int) -> float:
    return metric_sum(up.metrics("decode", i), "splitserve_worker_requests_total", rpc="generate", status="ok")


def _decisions(up: Up, policy: str) -> float:
    with urllib.request.urlopen(up.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("splitserve_router_decisions_total{") and f'policy="{policy}"' in line)


@pytest.fixture(scope="module")
def two_colocated():
    up = Up("--mode", "colocated", "--decode", "2", "--routing", "round_robin")
    yield up
    assert up.stop() == 0


def test_round_robin_spreads_evenly_across_two_workers(two_colocated):
    up = two_colocated
    c = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = [_worker_requests(up, i) for i in (0, 1)]
    for i in range(8):
        c.completions.create(model="smollm2", prompt=f"Count to {i}:", max_tokens=2, temperature=0)
    after = [_worker_requests(up, i) for i in (0, 1)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [4, 4]
    assert _decisions(up, "round_robin") >= 8
    assert _decisions(up, "least_loaded") == 0


def test_least_loaded_spreads_concurrent_requests_as_before():
    """Today's behaviour: eight requests in flight at once go four and four (fewest outstanding first)."""
    up = Up("--mode", "colocated", "--decode", "2")
    try:
        async def main():
            async with openai.AsyncOpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
                await asyncio.gather(*(c.completions.create(model="smollm2", prompt=f"Story {i}:", max_tokens=24,
                                                            temperature=0, extra_body={"ignore_eos": True})
                                       for i in range(8)))

        asyncio.run(main())
        assert [_worker_requests(up, i) for i in (0, 1)] == [4, 4]
        assert _decisions(up, "least_loaded") == 8
    finally:
        assert up.stop() == 0
