"""No stream lost, with real processes and real SmolLM2: a decode worker SIGKILLed or drained out of time in the
middle of 16 streams costs none of them. Each stream moves to the surviving worker, which continues after the
tokens already sent (its health lists `resume`); the client sees one stream whose text is the text of the same
request run undisturbed (greedy, and seeded sampling: each output position draws from (seed, position)), with
its finish_reason and usage. With the KV pool, the survivor loads the moved streams' blocks instead of computing
them."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from support.serving import Up, metric_sum, scrape

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
STORIES = ["a lighthouse keeper", "a lost robot", "two rival bakers", "a dragon who hated gold", "a quiet library",
           "a ship in a bottle", "the last train home", "a garden on the moon"]


def bodies(n: int, sampled: int, prefix: str = "") -> list[dict]:
    """`n` streamed completions: the first `sampled` seeded at temperature 0.9, the rest greedy."""
    out = []
    for i in range(n):
        body = {"model": "smollm2", "prompt": f"{prefix}Story {i}: {STORIES[i % len(STORIES)]}. Once upon a time,",
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        body.update({"temperature": 0.9, "seed": 1000 + i} if i < sampled else {"temperature": 0.0})
        out.append(body)
    return out


@dataclass
class Stream:
    text: str = ""
    tokens: int = 0  # chunks with text so far
    finish: str | None = None
    usage: dict | None = None
    errors: list[dict] = field(default_factory=list)
    status: int = 0


async def run(url: str, requests: list[dict], when_all_have: int = 0, then=None) -> list[Stream]:
    """Stream every request at once; once each has `when_all_have` text chunks, call `then()` (once)."""
    streams = [Stream() for _ in requests]
    reached = asyncio.Event()

    async def one(client: httpx.AsyncClient, body: dict, s: Stream) -> None:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            s.status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    s.errors.append(event["error"])
                    continue
                if event.get("usage"):
                    s.usage = event["usage"]
                for choice in event["choices"]:
                    s.text += choice["text"]
                    s.tokens += bool(choice["text"])
                    s.finish = choice["finish_reason"] or s.finish
                if when_all_have and all(x.tokens >= when_all_have for x in streams):
                    reached.set()

    async def trigger() -> None:
        await asyncio.wait_for(reached.wait(), 300)
        then()

    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [one(client, b, s) for b, s in zip(requests, streams, strict=True)]
        await asyncio.gather(*tasks, *([trigger()] if then is not None else []))
    return streams


def busier(up: Up) -> dict:
    """The decode worker with the most streams in flight (as the gateway sees it)."""
    workers = httpx.get(up.url + "/health", timeout=10).json()["workers"]
    endpoint = max(workers, key=lambda w: w["outstanding"])["endpoint"]
    return next(c for c in up.components["decode"] if c["grpc"] == endpoint)


def assert_undisturbed(moved: list[Stream], undisturbed: list[Stream]) -> None:
    for i, (s, u) in enumerate(zip(moved, undisturbed, strict=True)):
        assert s.status == 200 and not s.errors, (i, s)
        assert s.finish == "length" and s.usage is not None and s.usage["completion_tokens"] == MAX_TOKENS, (i, s)
        assert s.text == u.text, f"stream {i} differs after the move:\n{s.text!r}\n{u.text!r}"


def migrations(up: Up, **labels: str) -> float:
    return metric_sum(scrape(up.url), "splitserve_router_migrations_total", **labels)


CLUSTER = """apiVersion: splitserve.dev/v1alpha1
kind: SplitServeCluster
metadata: {name: moves}
spec:
  mode: colocated
  decode: {replicas: 3, drainSeconds: 0.1, engine: {batchInvariant: true}}
  router: {stallSeconds: 5}
"""
# drainSeconds 0.1: the drained worker's streams must outlast it (a fast box decoded the 37 tokens left of 40
# within 1 s, and nothing was left to move). batchInvariant: a moved stream's recomputed prefix and its next
# tokens are bit-equal to the undisturbed run's, whatever else shares the survivor's steps (without it a seeded
# draw near a boundary flips in float rounding)


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """Three colocated workers; each test below takes one away (stopped, drained, killed)."""
    cfg = tmp_path_factory.mktemp("moves") / "cluster.yaml"
    cfg.write_text(CLUSTER)
    up = Up("-f", str(cfg))
    yield up
    up.stop()


def alive(up: Up) -> list[dict]:
    return [c for c in up.components["decode"] if _alive(c["pid"])]


def test_a_stalled_worker_s_streams_move_after_stall_seconds(trio):
    """SIGSTOP the busiest worker: its streams send nothing more, and after router.stallSeconds each moves to
    another worker and completes as if undisturbed."""
    up = trio
    requests = bodies(6, sampled=2, prefix="Stall. ")
    undisturbed = asyncio.run(run(up.url, requests))
    victim = {}

    def stop() -> None:
        victim.update(busier(up))
        os.kill(victim["pid"], signal.SIGSTOP)

    try:
        moved = asyncio.run(run(up.url, requests, when_all_have=3, then=stop))
    finally:
        if victim:
            os.kill(victim["pid"], signal.SIGCONT)
    assert_undisturbed(moved, undisturbed)
    assert migrations(up, reason="stall", outcome="resumed") >= 1


def test_a_drain_that_runs_out_of_time_moves_its_streams(trio):
    """SIGTERM a worker whose drainSeconds is shorter than its streams: what is still running when the drain
    ends moves to another worker (reason drain), every stream completes as if undisturbed, and the worker exits."""
    up = trio
    requests = bodies(8, sampled=2, prefix="Drain. ")
    undisturbed = asyncio.run(run(up.url, requests))
    victim = {}

    def term() -> None:
        victim.update(busier(up))
        os.kill(victim["pid"], signal.SIGTERM)

    with up.explained():  # a failure shows what the gateway and the workers logged, and every move's reason
        moved = asyncio.run(run(up.url, requests, when_all_have=3, then=term))
        assert_undisturbed(moved, undisturbed)
        assert migrations(up, reason="drain", outcome="resumed") >= 1, {
            k: v for k, v in scrape(up.url).items() if k.startswith("splitserve_router_migrations_total")}
    deadline = time.monotonic() + 30
    while _alive(victim["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(victim["pid"])  # it exited once its streams had moved


def test_a_decode_worker_sigkilled_mid_stream_costs_no_stream(trio):
    """16 concurrent streams over 2 workers (12 greedy, 4 seeded at temperature 0.9); SIGKILL the busier
    worker once every stream has sent a few tokens: 16/16 complete, each equal to its undisturbed run."""
    up = trio
    assert len(alive(up)) == 2
    requests = bodies(16, sampled=4)
    undisturbed = asyncio.run(run(up.url, requests))
    assert all(s.finish == "length" and not s.errors for s in undisturbed)
    victim = {}

    def kill() -> None:
        victim.update(busier(up))
        os.kill(victim["pid"], signal.SIGKILL)

    moved = asyncio.run(run(up.url, requests, when_all_have=4, then=kill))
    assert_undisturbed(moved, undisturbed)
    assert migrations(up, reason="worker_gone", outcome="resumed") >= 1
    assert migrations(up, outcome="limit") == migrations(up, outcome="no_worker") == 0
    assert metric_sum(scrape(up.url), "splitserve_router_migration_gap_seconds_count") >= 1


def test_no_worker_left_ends_the_stream_with_finish_reason_error_and_usage(trio):
    """The one worker left is killed too: nothing can continue the streams, so each ends with
    finish_reason error and its usage (not a bare error event)."""
    up = trio
    last = alive(up)
    assert len(last) == 1, last

    def kill() -> None:
        os.kill(last[0]["pid"], signal.SIGKILL)

    streams = asyncio.run(run(up.url, bodies(2, sampled=0, prefix="Again. "), when_all_have=2, then=kill))
    for s in streams:
        assert s.status == 200 and not s.errors, s
        assert s.finish == "error", s
        assert s.usage is not None and 2 <= s.usage["completion_tokens"] < MAX_TOKENS, s
    # (`up` stops the whole cluster once its last decode worker is gone, so nothing more is asked of the gateway
    # here; test_gateway_migration.py counts the no_worker outcome)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_with_the_kv_pool_the_survivor_loads_the_moved_streams_blocks():
    """Over a KV pool: once the busier worker's prompts are in the pool, SIGKILL it; the survivor loads their
    blocks instead of computing them, and every stream completes as the survivor alone then runs it."""
    up = Up("--mode", "colocated", "--decode", "2", "--kv-pool", "--routing", "least_loaded")
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(1000, 30000) for _ in range(320)] for _ in range(4)]  # 20 blocks each
        requests = [{"model": "smollm2", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                     "stream": True, "stream_options": {"include_usage": True}} for p in prompts]
        victim = {}

        def kill() -> None:
            victim.update(busier(up))
            i = up.components["decode"].index(victim)
            deadline = time.monotonic() + 300  # a bound, not a speed goal: the pool writes behind, between steps
            while metric_sum(up.metrics("decode", i), "splitserve_kv_pool_blocks_written_total") < 40:
                assert time.monotonic() < deadline, "the pool writer did not write the victim's prompts"
                time.sleep(0.1)
            os.kill(victim["pid"], signal.SIGKILL)

        moved = asyncio.run(run(up.url, requests, when_all_have=2, then=kill))
        survivor = next(i for i, c in enumerate(up.components["decode"]) if c["pid"] != victim["pid"])
        assert metric_sum(up.metrics("decode", survivor), "splitserve_kv_pool_hit_tokens_total") >= 320
        undisturbed = asyncio.run(run(up.url, requests))
        assert_undisturbed(moved, undisturbed)
        assert migrations(up, reason="worker_gone", outcome="resumed") >= 1
    finally:
        up.stop()
