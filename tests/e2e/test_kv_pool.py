"""The Redis-backed KV pool: its block format on its own, blocks moved between two engines in process, and real
workers with a real redis-server (and a three-master Redis Cluster): loads that give the same tokens as
computing, corrupted and evicted blocks recomputed, Redis killed mid-run."""

from __future__ import annotations

import random

import httpx
import pytest
from support.helpers import greedy, make_engine
from support.redis_server import RedisCluster, RedisServer
from support.serving import Up, metric_sum

from splitserve.common.hashing import hash_token_blocks
from splitserve.common.redis_wire import ChecksumError, PoolNamespace, WireError, pool_hash_of_key

pytestmark = pytest.mark.slow

NS = PoolNamespace("m", "float32", 16, 2, 2, 8)


def test_block_format_round_trip_and_rejections():
    payload = bytes(range(256)) * (NS.payload_bytes // 256)
    raw = NS.encode_block(payload)
    assert bytes(NS.decode_block(raw)) == payload
    flipped = bytearray(raw)
    flipped[-5] ^= 0xFF
    with pytest.raises(ChecksumError):
        NS.decode_block(bytes(flipped))
    other = PoolNamespace("m", "float32", 16, 2, 2, 16)  # another layout never reads these bytes
    with pytest.raises(WireError):
        other.decode_block(raw)
    with pytest.raises(WireError):
        NS.decode_block(raw[:-1])
    assert pool_hash_of_key(NS.key(0xDEADBEEF)) == 0xDEADBEEF and pool_hash_of_key("ss:v1:x") is None
    assert NS.key(1) != PoolNamespace("m", "bfloat16", 16, 2, 2, 8).key(1)


def test_blocks_move_between_engines_and_give_the_same_tokens(smollm2_dir):
    """Engine A computes a prompt; its blocks, exported by hash, are loaded into engine B's reservation; B
    computes only the rest and generates exactly what computing everything gives."""
    import asyncio

    from splitserve.engine.async_engine import AsyncEngine

    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(200)]
    a, b, c = (make_engine(smollm2_dir) for _ in range(3))
    expected = c.generate([prompt], greedy(12, ignore_eos=True))[0]["token_ids"]
    a.generate([prompt], greedy(1))
    hashes = hash_token_blocks(prompt[:192], 16, a.model_name)  # 12 blocks (one token always left to compute)
    found, data = a.export_blocks(hashes)
    assert found == hashes and data.shape == (12, 2 * 30 * 16 * 3 * 64 * 4)  # SmolLM2: 30 layers, 3 KV heads

    async def run():
        eng = AsyncEngine(b)
        try:
            assert await eng.reserve_remote("r", prompt, greedy(12, ignore_eos=True)) is not None
            tokens, loaded = [], 0
            async for out in eng.stream_loaded("r", 0, data):
                tokens += out.new_token_ids
                loaded = out.num_loaded_tokens
            return tokens, loaded, eng.stats()
        finally:
            eng.shutdown()

    tokens, loaded, stats = asyncio.run(run())
    assert tokens == expected and loaded == 192
    assert stats["kv_blocks_used"] == 0  # finished: every block back in the pool


def long_prompt(seed: int, n: int = 600) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def pool_metric(up: Up, i: int, name: str, **labels) -> float:
    return metric_sum(up.metrics("decode", i), name, **labels)


def pool_cluster(*extra: str) -> Up:
    """Two colocated workers taking turns (round robin: decode-0, decode-1, ...) over a KV pool."""
    return Up("--mode", "colocated", "--decode", "2", "--routing", "round_robin", "--kv-pool", *extra)


def wait_for_writes(up: Up, i: int, blocks: int) -> None:
    import time

    # bounded wait, not a speed goal: on a loaded 2-core box a write has been seen to land only after ~180 s
    deadline = time.monotonic() + 300
    while pool_metric(up, i, "splitserve_kv_pool_blocks_written_total") < blocks:
        assert time.monotonic() < deadline, ("the pool writer did not write", [
            {k: v for k, v in up.metrics("decode", j).items() if "kv_pool" in k and "created" not in k}
            for j in (0, 1)])
        time.sleep(0.1)


def counts(up: Up, name: str, **labels) -> list[float]:
    return [pool_metric(up, i, name, **labels) for i in (0, 1)]


def computed_by(up: Up, prompt_tokens: list[float]) -> int:
    """The worker (0 or 1) whose prompt-token counter rose since `prompt_tokens`: the one that took the request."""
    now = counts(up, "splitserve_worker_prompt_tokens_total")
    [i] = [i for i in (0, 1) if now[i] > prompt_tokens[i]]
    return i


class TestSharedPool:
    """Loads from the pool and a corrupted block, on one pool cluster (torn down after these two)."""

    @pytest.fixture(scope="class")
    @classmethod
    def pool(cls):
        """One pool cluster (with its bundled Redis) for tests that write their own prompts' blocks and read
        them back: each sends prompts of its own and counts from the metrics as it found them."""
        up = pool_cluster()
        yield up
        assert up.stop() == 0

    def test_a_second_worker_loads_the_shared_blocks_and_matches_computing(self, smollm2_dir, pool):
        base = long_prompt(1)
        turn = base + long_prompt(2, 40)
        expected = make_engine(smollm2_dir).generate([turn], greedy(8, ignore_eos=True))[0]["text"]
        up = pool
        prompts = counts(up, "splitserve_worker_prompt_tokens_total")
        written = counts(up, "splitserve_kv_pool_blocks_written_total")
        first = complete(up.url, base)  # one worker computes it and writes its 37 blocks
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        w = computed_by(up, prompts)
        wait_for_writes(up, w, written[w] + 37)
        other = 1 - w  # round robin: the next request goes to the other worker
        hits = counts(up, "splitserve_kv_pool_hit_tokens_total")
        prefix = counts(up, "splitserve_worker_prefix_hit_tokens_total")
        second = complete(up.url, turn)  # the other worker: loads the 37 shared blocks, computes the other 48
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 592
        assert pool_metric(up, other, "splitserve_kv_pool_hit_tokens_total") - hits[other] == 592
        # none computed or cached
        assert pool_metric(up, other, "splitserve_worker_prefix_hit_tokens_total") - prefix[other] == 0
        assert second["choices"][0]["text"] == expected

    def test_a_corrupted_block_is_recomputed_and_counted(self, smollm2_dir, pool):
        prompt = long_prompt(3)
        expected = make_engine(smollm2_dir).generate([prompt], greedy(8, ignore_eos=True))[0]["text"]
        up = pool
        prompts = counts(up, "splitserve_worker_prompt_tokens_total")
        written = counts(up, "splitserve_kv_pool_blocks_written_total")
        complete(up.url, prompt)
        w = computed_by(up, prompts)
        wait_for_writes(up, w, written[w] + 37)
        import redis

        r = redis.Redis.from_url(up.components["redis"]["url"])
        keys = sorted(k for k in r.keys("ss:pool:*"))
        hashes = hash_token_blocks(prompt, 16, "smollm2")
        victim = next(k for k in keys if k.decode().endswith(f"{hashes[10]:016x}"))
        r.setrange(victim, 200, b"\x00\x01\x02\x03")  # bytes flipped in Redis
        other = 1 - w
        errors = counts(up, "splitserve_kv_pool_errors_total", reason="checksum")
        hits = counts(up, "splitserve_kv_pool_hit_tokens_total")
        out = complete(up.url, prompt)  # the other worker: loads blocks 0-9, block 10 fails its checksum
        assert pool_metric(up, other, "splitserve_kv_pool_errors_total", reason="checksum") - errors[other] == 1
        assert pool_metric(up, other, "splitserve_kv_pool_hit_tokens_total") - hits[other] == 160
        assert out["choices"][0]["text"] == expected


class TestSmallRedis:
    """Eviction, then the Redis killed, on one pool cluster over a small redis-server (torn down after
    these two)."""

    @pytest.fixture(scope="class")
    @classmethod
    def small_redis(cls):
        """A pool cluster over a redis-server of its own, far smaller than the working set (40 MB): the
        eviction test fills it, then the next test kills it."""
        redis = RedisServer(extra=("--maxmemory", "40mb", "--maxmemory-policy", "volatile-lru"))
        up = pool_cluster("--redis-url", redis.url)
        yield redis, up
        up.stop()
        redis.close()

    def test_eviction_under_maxmemory_degrades_gracefully(self, small_redis):
        """A pool far smaller than the working set: Redis evicts blocks LRU, loads of evicted blocks are misses,
        recent prompts still hit, and no request fails."""
        redis, up = small_redis
        hits = sum(counts(up, "splitserve_kv_pool_hit_tokens_total"))
        written = sum(counts(up, "splitserve_kv_pool_blocks_written_total"))
        for seed in range(10, 13):  # three 37-block prompts: ~80 MB of blocks into 40 MB
            complete(up.url, long_prompt(seed))
        assert int(redis.cli("info", "stats").split("evicted_keys:")[1].split()[0]) > 0
        for seed in (12, 10):  # the newest prompt can hit; the oldest was evicted
            complete(up.url, long_prompt(seed))
        assert sum(counts(up, "splitserve_kv_pool_hit_tokens_total")) - hits > 0
        assert sum(counts(up, "splitserve_kv_pool_blocks_written_total")) - written >= 3 * 30

    def test_redis_killed_mid_run_every_request_succeeds(self, small_redis):
        """Runs after the eviction test on the same cluster (it kills the Redis)."""
        redis, up = small_redis
        hits = sum(counts(up, "splitserve_kv_pool_hit_tokens_total"))
        complete(up.url, long_prompt(4))
        redis.stop()
        for i in range(4):
            complete(up.url, long_prompt(4 if i % 2 else 5))
        assert sum(counts(up, "splitserve_kv_pool_hit_tokens_total")) - hits == 0


def test_the_same_load_works_against_a_redis_cluster(smollm2_dir):
    cluster = RedisCluster()
    base = long_prompt(6)
    up = pool_cluster("--redis-url", cluster.url)
    try:
        complete(up.url, base)
        wait_for_writes(up, 0, 37)
        second = complete(up.url, base)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 592
        assert pool_metric(up, 1, "splitserve_kv_pool_hit_tokens_total") == 592
        sizes = [int(n.cli("dbsize").strip() or 0) for n in cluster.nodes]
        assert sum(1 for s in sizes if s > 0) >= 2  # blocks spread over the masters by hash slot
    finally:
        up.stop()
        cluster.close()


def test_a_pool_read_held_up_past_the_worker_links_deadline_still_loads(smollm2_dir):
    """Redis stalls (DEBUG SLEEP, as a loaded host stalls it) while a worker looks a prompt up in the pool.
    A stall of 1.5 s is past the 1-s socket deadline of the worker's own Redis link, but the pool reads over a
    link of its own whose deadline is `kvPool.readTimeoutSeconds` (5 s): the blocks load, the tokens are the
    computed ones, and no link goes down. A stall past readTimeoutSeconds (1 s here) is abandoned: the prompt
    is computed, counted as a timeout."""
    import asyncio
    import threading

    from prometheus_client import REGISTRY

    from splitserve.common.config import ClusterSpec
    from splitserve.common.membership import StaticMembership
    from splitserve.common.redis_link import RedisLink
    from splitserve.common.redis_wire import Keys
    from splitserve.common.worker_context import WorkerContext
    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.kv_transfer.pool import make_pool

    def sample(name: str, **labels) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    redis = RedisServer()
    prompt = long_prompt(7, 200)
    params = greedy(8, ignore_eos=True)
    expected = make_engine(smollm2_dir).generate([prompt], params)[0]["token_ids"]

    async def run(read_timeout: float, stall_s: float) -> tuple[list[int], int, list[bool]]:
        # the pools never write on their own ("prefill" is not in writeFrom): the test writes the blocks
        spec = ClusterSpec.model_validate({"kvPool": {"enabled": True, "writeFrom": ["decode"],
                                                      "readTimeoutSeconds": read_timeout}})
        keys = Keys(spec.model.served_name)
        link = RedisLink(redis.url)  # the worker's own link, as a worker process makes it (1-s deadline)
        await link.start()
        ctx = WorkerContext("w", "i", "127.0.0.1", StaticMembership([], []), link, keys)
        writer_engine, reader_engine = AsyncEngine(make_engine(smollm2_dir)), AsyncEngine(make_engine(smollm2_dir))
        writer = await make_pool(spec, writer_engine, ctx, "prefill")
        reader = await make_pool(spec, reader_engine, ctx, "prefill")
        assert writer is not None and reader is not None and reader.link is not link
        try:
            async for _ in writer_engine.generate("w", prompt, greedy(1)):
                pass
            hashes = hash_token_blocks(prompt[:192], 16, writer_engine.facts.name)
            assert await writer.write_blocks(hashes) == 12
            stalled = threading.Event()

            def stall() -> None:
                stalled.set()
                redis.cli("debug", "sleep", str(stall_s))  # Redis answers no one meanwhile

            stalling = asyncio.create_task(asyncio.to_thread(stall))
            await asyncio.to_thread(stalled.wait)
            await asyncio.sleep(0.2)  # the DEBUG SLEEP reached Redis
            tokens, loaded = [], 0
            async for out in reader.generate("r", prompt, params):
                tokens += out.new_token_ids
                loaded = max(loaded, out.num_loaded_tokens)
            await stalling
            return tokens, loaded, [link.up, reader.link.up, link.failures == 0]
        finally:
            for pool in (writer, reader):
                await pool.close()
            await link.close()
            writer_engine.shutdown()
            reader_engine.shutdown()

    try:
        hits = sample("splitserve_kv_pool_hit_tokens_total")
        tokens, loaded, links = asyncio.run(run(read_timeout=5.0, stall_s=1.5))
        assert tokens == expected and loaded == 192
        assert sample("splitserve_kv_pool_hit_tokens_total") - hits == 192
        assert links == [True, True, True]

        redis.cli("flushall")
        timeouts = sample("splitserve_kv_pool_errors_total", reason="timeout")
        tokens, loaded, _ = asyncio.run(run(read_timeout=1.0, stall_s=2.5))
        assert tokens == expected and loaded == 0
        assert sample("splitserve_kv_pool_errors_total", reason="timeout") - timeouts == 1
    finally:
        redis.close()
