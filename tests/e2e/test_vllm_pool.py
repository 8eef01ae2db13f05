"""The KV pool with engine vllm, end to end: `splitserve up --engine vllm --kv-pool` (one real vLLM CPU server with
our pool connector, a real redis-server), driven with the `openai` client. A prompt computed once is stored under
our chained hashes and announced as pool blocks; after vLLM's own prefix cache is reset, the same prompt is loaded
from the pool (vLLM reports the hit) and gives the same greedy answer; a block corrupted in Redis is caught by its
checksum and recomputed; with Redis gone, the request is computed and succeeds."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis
import yaml
from support.redis_server import RedisServer
from support.serving import Up, metric_sum, vllm_server_of

from splitserve.common.hashing import hash_token_blocks
from splitserve.common.redis_wire import Keys, KVEventRecord, pool_hash_of_key

pytestmark = pytest.mark.slow

BS = 32
PROMPT = [random.Random(7).randrange(1000, 30000) for _ in range(300)]  # 9 full blocks: 288 tokens to load
HASHES = hash_token_blocks(PROMPT[:288], BS, "smollm2")


class Pooled:
    def __init__(self, config: Path) -> None:
        self.redis = RedisServer()
        old = os.environ.get("VLLM_SERVER_DEV_MODE")
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM's POST /reset_prefix_cache
        try:
            self.up = Up("-f", str(config), "--engine", "vllm", "--mode", "colocated", "--decode", "1",
                         "--kv-pool", "--redis-url", self.redis.url, timeout=900)
        except BaseException:
            self.redis.close()
            raise
        finally:
            if old is None:
                os.environ.pop("VLLM_SERVER_DEV_MODE")
        args = vllm_server_of(self.up.components["decode"][0]["pid"])[1]
        self.vllm_url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
        self.client = openai.OpenAI(base_url=self.up.url + "/v1", api_key="none", timeout=300)
        self.r = redis.Redis.from_url(self.redis.url)

    def complete(self, prompt: list[int] = PROMPT):
        return self.client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.up.metrics("decode"), name, **labels)

    def wait_metric(self, name: str, at_least: float, **labels: str) -> float:
        deadline = time.monotonic() + 60  # bounded wait: the counters reach the worker about once a second
        while (value := self.metric(name, **labels)) < at_least:
            assert time.monotonic() < deadline, (name, value, at_least)
            time.sleep(0.2)
        return value

    def forget(self) -> None:
        """Empty vLLM's own prefix cache: what it does not compute again now comes from the pool."""
        r = httpx.post(self.vllm_url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200 and r.json().get("success") is not False, r.text

    def close(self) -> None:
        try:
            assert self.up.stop() == 0
        finally:
            self.redis.close()


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    # float32: this CPU has no bfloat16 instructions, and vLLM computes bfloat16 several times slower here
    config = tmp_path_factory.mktemp("pool") / "cluster.yaml"
    config.write_text(yaml.safe_dump({"apiVersion": "splitserve.dev/v1alpha1", "kind": "SplitServeCluster",
                                      "metadata": {"name": "vllm-pool"}, "spec": {"model": {"dtype": "float32"}}}))
    p = Pooled(config)
    yield p
    p.close()


@pytest.fixture(scope="module")
def first(pooled):
    """The prompt computed once, its 9 full blocks stored in the pool."""
    out = pooled.complete()
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    pooled.wait_metric("splitserve_kv_pool_blocks_written_total", 9)
    return out.choices[0].text


def test_a_computed_prompt_is_stored_under_our_hashes_and_announced_to_the_gateways(pooled, first):
    keys = pooled.r.keys("ss:pool:*")
    assert {pool_hash_of_key(k) for k in keys} == set(HASHES)  # the router's hashes, in vLLM's namespace
    assert all(b":float32:b32:l30h3d64:tp0-1:vllm-cpu:" in k for k in keys)
    records = [KVEventRecord.decode(f) for _, f in pooled.r.xrange(Keys("smollm2").events)]
    pool_hashes = [h for rec in records if rec.tier == "pool" for h in rec.hashes.tolist()]
    gpu_hashes = {h for rec in records if rec.tier == "gpu" and rec.kind == "stored" for h in rec.hashes.tolist()}
    assert pool_hashes == HASHES and set(HASHES) <= gpu_hashes  # the same names as vLLM's own blocks' events


def test_after_a_prefix_cache_reset_the_prompt_loads_from_the_pool_with_the_same_answer(pooled, first):
    hits = pooled.metric("splitserve_kv_pool_hit_tokens_total")
    pooled.forget()
    out = pooled.complete()
    assert out.usage.prompt_tokens_details.cached_tokens == 288  # vLLM counts the loaded tokens as a hit
    assert pooled.wait_metric("splitserve_kv_pool_hit_tokens_total", hits + 288) == hits + 288
    assert out.choices[0].text == first


def test_a_block_corrupted_in_redis_is_caught_and_recomputed(pooled, first):
    hits = pooled.metric("splitserve_kv_pool_hit_tokens_total")
    victim = next(k for k in pooled.r.keys("ss:pool:*") if pool_hash_of_key(k) == HASHES[4])
    pooled.r.setrange(victim, 1000, b"\x00\x01\x02\x03")  # bytes changed in Redis
    pooled.forget()
    out = pooled.complete()  # blocks 0-3 load; block 4 fails its checksum: vLLM recomputes from it
    pooled.wait_metric("splitserve_kv_pool_errors_total", 1, reason="checksum")
    assert pooled.wait_metric("splitserve_kv_pool_hit_tokens_total", hits + 4 * BS) == hits + 4 * BS
    assert out.choices[0].text == first
    assert not pooled.r.exists(victim)  # dropped, so that the next worker computing it stores it again


def test_with_redis_down_the_prompt_is_computed_and_succeeds(pooled, first):
    hits = pooled.metric("splitserve_kv_pool_hit_tokens_total")
    pooled.redis.stop()
    pooled.forget()
    out = pooled.complete()
    assert out.choices[0].text == first and out.usage.prompt_tokens_details.cached_tokens == 0
    assert pooled.metric("splitserve_kv_pool_hit_tokens_total") == hits
