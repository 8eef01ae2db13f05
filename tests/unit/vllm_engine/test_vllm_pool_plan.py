"""The KV pool for engine vllm without a vLLM process: the scheduler side's plan (which blocks to load, which to
store, under which of our hashes), the connector's settings as the worker hands them to vLLM, and the worker's
mirror of the connector's counters."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client import REGISTRY

from splitserve.common.config import ClusterResource
from splitserve.common.hashing import hash_token_blocks
from splitserve.common.redis_wire import PoolNamespace
from splitserve.vllm_engine.in_vllm.pool_plan import PoolPlanner, PoolSettings, StatsDelta
from splitserve.vllm_engine.pool_stats import PoolStatsMirror
from splitserve.vllm_engine.server import VllmPorts, command, environment

BS = 32
SALT = "smollm2"
PORTS = VllmPorts(8200, 5557, 5600)


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


class FakePool:
    """The pool as a set of block hashes; `asked` records each EXISTS batch."""

    def __init__(self, hashes=(), up: bool = True) -> None:
        self.hashes, self.up, self.asked = set(hashes), up, []

    def exists(self, hashes):
        self.asked.append(list(hashes))
        return [h in self.hashes for h in hashes] if self.up else None


def planner(pool: FakePool, write: bool = True, min_load: int = 64) -> PoolPlanner:
    return PoolPlanner(BS, SALT, min_load, write, pool.exists)


def test_lookup_counts_the_leading_run_beyond_the_local_hit_and_keeps_the_last_token():
    prompt = tokens(300)  # 9 full blocks; the last token (300th) is in a partial block anyway
    hashes = hash_token_blocks(prompt, BS, SALT)
    pool = FakePool(hashes[:6] + hashes[7:])  # block 6 missing: the run ends there
    p = planner(pool)
    assert p.lookup("a", prompt, 0) == 6 * BS
    assert p.lookup("a", prompt, 2 * BS) == 4 * BS and pool.asked[-1] == hashes[2:9]  # beyond vLLM's own
    exact = tokens(4 * BS, seed=1)  # whole blocks: the last one holds the token to compute, so it is not asked
    p2 = planner(FakePool(hash_token_blocks(exact, BS, SALT)))
    assert p2.lookup("b", exact, 0) == 3 * BS
    assert planner(FakePool(hashes[:1])).lookup("c", prompt, 0) == 0  # under minLoadTokens (64)
    assert planner(FakePool(hashes, up=False)).lookup("d", prompt, 0) == 0  # Redis down: compute
    short = FakePool(hashes)
    assert planner(short).lookup("e", prompt[:40], 0) == 0 and short.asked == []  # nothing worth asking


def test_loads_name_the_reserved_blocks_and_steps_store_what_they_complete():
    prompt = tokens(300, seed=2)
    hashes = hash_token_blocks(prompt, BS, SALT)
    p = planner(FakePool(hashes[:4]))
    assert p.lookup("r", prompt, BS) == 3 * BS  # vLLM holds block 0; the pool has 1-3
    request_tokens = list(prompt)
    block_ids = [40 + i for i in range(10)]
    p.allocated("r", request_tokens, block_ids, 3 * BS)
    # first step: a chunk of 128 tokens past the 4 blocks held (block 0) or loaded (1-3)
    step = p.step([("r", 4 * BS, 128, block_ids, True)])
    assert [(x.req_id, x.block_ids, x.block_hashes) for x in step.loads] == [("r", (41, 42, 43), tuple(hashes[1:4]))]
    assert step.lookup_tokens == 8 * BS  # looked up beyond the local hit: blocks 1-8
    assert step.save_block_ids == [44, 45, 46, 47] and step.save_hashes == hashes[4:8]
    # the rest of the prompt: block 8 completes (300 tokens: 9 full blocks); then decoding fills block 9
    step = p.step([("r", 8 * BS, 300 - 8 * BS, None, False)])
    assert not step.loads and step.save_block_ids == [48] and step.save_hashes == hashes[8:9]
    request_tokens += tokens(20, seed=3)  # vLLM appends the output to the request's live list: 320 tokens
    assert p.step([("r", 318, 1, None, False)]).save_block_ids == []  # 319 computed: block 9 not full yet
    step = p.step([("r", 319, 1, [50], False)])  # the 320th token: block 9 is full
    assert step.save_block_ids == [49] and step.save_hashes == hash_token_blocks(request_tokens, BS, SALT)[9:10]
    p.finished("r")
    assert p.step([("r", 400, 1, None, False)]).save_block_ids == []  # forgotten


def test_a_block_completed_by_a_decode_step_is_stored_under_the_chained_hash_of_prompt_and_output():
    prompt = tokens(70, seed=4)
    output = tokens(30, seed=5)
    live = list(prompt)
    p = planner(FakePool())
    assert p.lookup("r", prompt, 0) == 0
    p.allocated("r", live, [7, 8, 9], 0)
    assert p.step([("r", 0, 70, [7, 8, 9], True)]).save_block_ids == [7, 8]  # two full prompt blocks
    live += output[:26]  # 96 tokens: the 26th output token completes block 2 once it is computed
    step = p.step([("r", 95, 1, None, False)])
    assert step.save_block_ids == [9] and step.save_hashes == hash_token_blocks(prompt + output[:26], BS, SALT)[2:3]


def test_a_resumed_request_replaces_its_blocks_and_nothing_is_stored_without_writeFrom():
    prompt = tokens(200, seed=6)
    p = planner(FakePool())
    p.allocated("r", list(prompt), [1, 2, 3, 4, 5, 6, 7], 0)
    assert p.step([("r", 0, 64, [1, 2, 3, 4, 5, 6, 7], True)]).save_block_ids == [1, 2]
    step = p.step([("r", 64, 136, [11, 12, 13, 14, 15, 16, 17], True)])  # preempted and resumed elsewhere
    assert step.save_block_ids == [13, 14, 15, 16]
    quiet = planner(FakePool(), write=False)
    quiet.allocated("q", list(prompt), [1, 2, 3, 4, 5, 6, 7], 0)
    assert quiet.step([("q", 0, 200, None, False)]).save_block_ids == []


def test_the_connector_settings_travel_in_the_kv_transfer_config():
    spec = ClusterResource.model_validate({"metadata": {"name": "t"}, "spec": {
        "engine": "vllm", "mode": "colocated", "model": {"device": "cpu"}, "redis": {"url": "redis://10.0.0.9:6379"},
        "kvPool": {"enabled": True, "minLoadTokens": 96, "writeFrom": ["prefill"], "lookupTimeoutSeconds": 0.05}}}).spec
    cmd = command(spec, "both", "/m", PORTS, pool_identity=("w-1.vllm-pool", "abc"))
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "SplitservePoolConnector" and transfer["kv_load_failure_policy"] == "recompute"
    assert transfer["kv_connector_module_path"] == "splitserve.vllm_engine.in_vllm.pool_connector"
    settings = PoolSettings.from_extra(transfer["kv_connector_extra_config"])
    # a colocated worker writes as decode does: not with writeFrom [prefill]
    assert (settings.model, settings.worker, settings.instance_id, settings.min_load_tokens, settings.write,
            settings.lookup_timeout_seconds) == ("smollm2", "w-1.vllm-pool", "abc", 96, False, 0.05)
    assert "redis://" not in " ".join(cmd)  # the URL goes in the environment, not on the command line
    assert environment(spec, "both", PORTS, "h")["SPLITSERVE_REDIS_URL"] == "redis://10.0.0.9:6379"
    disagg = ClusterResource.model_validate({"metadata": {"name": "t"}, "spec": {
        "engine": "vllm", "model": {"device": "cpu"}, "kvPool": {"enabled": True}}}).spec
    cmd = command(disagg, "prefill", "/m", PORTS)  # rendered for a pod: no identity, the server names itself
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "MultiConnector" and transfer["kv_load_failure_policy"] == "recompute"
    handover, pool = transfer["kv_connector_extra_config"]["connectors"]  # vllm.connector's first: its KV wins
    assert handover["kv_connector"] == "SplitserveLayerwiseConnector" and pool["kv_connector"] == "SplitservePoolConnector"
    settings = PoolSettings.from_extra(pool["kv_connector_extra_config"])
    assert settings.worker.endswith(".vllm-pool") and settings.write
    with pytest.raises(ValueError, match="min_load_tokens"):
        PoolSettings.from_extra({"splitserve_pool": {"model": "m", "min_load_tokens": 0}})
    with pytest.raises(ValueError, match="unknown setting"):
        PoolSettings.from_extra({"splitserve_pool": {"model": "m", "url": "redis://x"}})


def test_vllm_blocks_live_apart_from_the_native_engines():
    native = PoolNamespace("smollm2", "float32", 32, 30, 3, 64)
    vllm = PoolNamespace("smollm2", "float32", 32, 30, 3, 64, layout="vllm-cpu")
    assert native.key(5) != vllm.key(5) and vllm.key(5).endswith(":vllm-cpu:0000000000000005")
    with pytest.raises(ValueError):
        PoolNamespace("smollm2", "float32", 32, 30, 3, 64, layout="a:b")


def test_the_worker_mirrors_the_connectors_counters_from_the_first_reading_on():
    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    mirror = PoolStatsMirror(link=None, model="smollm2", pool_worker="w.vllm-pool")  # type: ignore[arg-type]
    hits, checksum = value("splitserve_kv_pool_hit_tokens_total"), value("splitserve_kv_pool_errors_total",
                                                                           reason="checksum")
    mirror.apply({b"hit_tokens": b"320"})  # left by an earlier server: the baseline
    assert value("splitserve_kv_pool_hit_tokens_total") == hits
    mirror.apply({b"hit_tokens": b"384", b"errors_checksum": b"1", b"other": b"x"})
    assert value("splitserve_kv_pool_hit_tokens_total") == hits + 64
    assert value("splitserve_kv_pool_errors_total", reason="checksum") == checksum + 1
    delta = StatsDelta()
    delta.add("hit_tokens", 32)
    delta.add("hit_tokens", 32)
    assert delta.take() == {"hit_tokens": 64} and delta.take() == {}


def test_a_pods_vllm_server_gets_the_pools_redis_from_the_secret_and_names_itself():
    from unit.hosts.test_operator_render import VLLM, VLLM_IMAGE, containers, flag, objects, pod

    objs = objects({**VLLM, "kvPool": {"enabled": True},
                    "redis": {"mode": "external", "urlSecret": {"name": "r", "key": "url"}}})
    server = containers(objs, "decode")["vllm"]
    assert {"name": "SPLITSERVE_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "r", "key": "url"}}} in server["env"]
    connectors = json.loads(flag(server["command"], "--kv-transfer-config"))["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in connectors] == ["SplitserveLayerwiseConnector", "SplitservePoolConnector"]
    assert "worker" not in connectors[1]["kv_connector_extra_config"]["splitserve_pool"]  # named after the pod
    # the stock vLLM image lacks splitserve: an init container of the worker image copies the connector into a
    # volume the server reads from its PYTHONPATH
    spec = pod(objs, "decode")
    init = {c["name"]: c for c in spec["initContainers"]}["pool-connector"]
    assert init["image"] == "ghcr.io/splitserve/worker:0.1.0" and server["image"] == VLLM_IMAGE
    assert init["command"] == ["splitserve", "vllm-connector", "/opt/splitserve/python"]
    assert init["volumeMounts"] == [{"name": "pool-connector", "mountPath": "/opt/splitserve/python"}]
    assert {"name": "pool-connector", "mountPath": "/opt/splitserve/python", "readOnly": True} in server["volumeMounts"]
    assert {"name": "PYTHONPATH", "value": "/opt/splitserve/python"} in server["env"]
    assert {"name": "pool-connector", "emptyDir": {}} in spec["volumes"]
    assert "initContainers" not in pod(objects({**VLLM, "vllm": {"connector": "pull"}}), "decode")  # nothing to copy


def test_an_unreachable_redis_answers_the_default_at_once_and_is_left_alone_for_a_moment():
    import time

    from support.serving import free_port

    from splitserve.vllm_engine.in_vllm.pool_plan import RedisHandle

    handle = RedisHandle(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2, backoff_s=30)
    assert handle.call(lambda r: r.ping(), "down") == "down" and handle.last_error == "redis"
    t0 = time.monotonic()
    assert handle.call(lambda r: r.ping(), "down") == "down" and time.monotonic() - t0 < 0.01  # not asked again
    assert RedisHandle(None, 0.2).call(lambda r: r.ping(), "none") == "none"  # no URL: no pool
