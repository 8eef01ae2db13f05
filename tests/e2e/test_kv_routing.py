"""KV-aware routing with real processes, a real redis-server and real SmolLM2: replicas that agree and survive
each other, workers that leave and come back under the same name, Redis that goes away and comes back, bad
records written straight into Redis, sessions, and a three-master Redis Cluster."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.redis_server import RedisCluster, RedisServer
from support.serving import Up, metric_sum, scrape

from splitserve.common.proc import free_ports

pytestmark = pytest.mark.slow

SHARED = [random.Random(7).randrange(1000, 30000) for _ in range(400)]  # a long shared prefix (25 blocks)


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return SHARED + [rng.randrange(1000, 30000) for _ in range(40)]


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def gateway_metrics(url: str) -> dict[str, float]:
    return scrape(url)


def complete(url: str, tokens: list[int], **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": tokens, "max_tokens": 2, **kw},
                      timeout=300)


def hit_rate(up: Up, before: list[dict]) -> float:
    """Matched prompt tokens / prompt tokens, from the workers' own counters since `before`."""
    hit = total = 0.0
    for i, b in enumerate(before):
        m = up.metrics("decode", i)
        hit += metric_sum(m, "splitserve_worker_prefix_hit_tokens_total") - b["hit"]
        total += metric_sum(m, "splitserve_worker_prompt_tokens_total") - b["total"]
    return hit / total


def counters(up: Up) -> list[dict]:
    return [{"hit": metric_sum(m, "splitserve_worker_prefix_hit_tokens_total"),
             "total": metric_sum(m, "splitserve_worker_prompt_tokens_total")}
            for m in (up.metrics("decode", i) for i in range(len(up.components["decode"])))]


def wait_until(check, timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def replicas():
    """Two gateway replicas and two colocated workers, kv_aware routing, the Redis `splitserve up` starts."""
    up = Up("--mode", "colocated", "--decode", "2", "--routing", "kv_aware", "--routers", "2")
    yield up
    assert up.stop() == 0


def test_both_replicas_see_the_same_index_and_hit_rate(replicas):
    up = replicas
    a, b = (r["url"] for r in up.components["routers"])
    before = counters(up)
    for i in range(6):
        assert complete(a, prompt(i)).status_code == 200
    rate_a = hit_rate(up, before)
    wait_until(lambda: health(b)["index"]["blocks"] == health(a)["index"]["blocks"], what="replicas to agree")
    wait_until(lambda: not any(w["peer_outstanding"] for w in health(b)["workers"]), what="A's load to clear on B")
    before = counters(up)
    cached = []
    for i in range(6, 12):
        r = complete(b, prompt(i))
        assert r.status_code == 200
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    rate_b = hit_rate(up, before)
    # B routes on what A's requests cached: every request finds the shared prefix
    assert rate_b >= 0.9 and rate_b >= rate_a, (rate_a, rate_b, cached, health(b))


def test_each_replica_counts_the_others_requests_in_flight(replicas):
    up = replicas
    a, b = (r["url"] for r in up.components["routers"])
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", a + "/v1/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()  # kept referenced: a collected iterator closes the stream
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first, first
        seen = []

        def b_sees_it() -> bool:
            seen.append((health(a)["workers"], health(b)["workers"]))
            return sum(w["peer_outstanding"] for w in seen[-1][1]) == 1

        try:
            wait_until(b_sees_it, what="B to see A's load")
        except AssertionError:
            raise AssertionError(f"B never saw A's request: {seen[:1]} ... {seen[-1:]}") from None


def test_a_replica_killed_mid_run_leaves_the_other_serving(replicas):
    """SIGKILL gateway A with streams in flight on it: their clients retry on B and succeed, B serves on, and
    the load A had reported for them leaves B's view once A's report expires."""
    up = replicas
    a, b = up.components["routers"]

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as c:
            async def one(i, url):
                r = await c.post(url + "/v1/completions", json={"model": "smollm2", "prompt": prompt(i),
                                                              "max_tokens": 2})
                return r.status_code

            async def retried(i):  # a client of A: A dies under it, it retries on B
                body = {"model": "smollm2", "prompt": prompt(i), "max_tokens": 64, "ignore_eos": True}
                try:
                    r = await c.post(a["url"] + "/v1/completions", json=body)
                    return r.status_code
                except httpx.TransportError:
                    r = await c.post(b["url"] + "/v1/completions", json=body)
                    return -r.status_code

            on_a = [asyncio.ensure_future(retried(i)) for i in range(30, 34)]
            first = await asyncio.gather(*(one(i, b["url"]) for i in range(20, 24)))
            deadline = time.monotonic() + 60
            while sum(w["peer_outstanding"] for w in health(b["url"])["workers"]) < 4:
                assert time.monotonic() < deadline, "B never saw A's streams"
                await asyncio.sleep(0.1)
            os.kill(a["pid"], signal.SIGKILL)
            rest = await asyncio.gather(*(one(i, b["url"]) for i in range(24, 30)))
            return first + rest + list(await asyncio.gather(*on_a))

    statuses = asyncio.run(run())
    assert statuses == [200] * 10 + [-200] * 4  # A's four clients all retried on B
    before = counters(up)
    for i in range(40, 44):
        assert complete(b["url"], prompt(i)).status_code == 200
    assert hit_rate(up, before) >= 0.8  # B still routes by the shared index
    wait_until(lambda: not any(w["peer_outstanding"] for w in health(b["url"])["workers"]),
               what="A's load to leave B's view")


def test_a_killed_worker_leaves_and_its_restart_carries_no_stale_entries(tmp_path):
    up = Up("--mode", "colocated", "--decode", "2", "--routing", "kv_aware")
    try:
        url = up.url
        for i in range(4):
            assert complete(url, prompt(i)).status_code == 200
        w = next(w for w in health(url)["workers"] if w["indexed_blocks"] > 0)
        victim = next(c for c in up.components["decode"] if c["name"] == w["name"])
        os.kill(victim["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: all(x["name"] != w["name"] for x in health(url)["workers"]), timeout=15,
                   what="the dead worker to leave the view")
        assert time.monotonic() - t0 < 8  # within its lease (5 s) and a registry poll
        assert not health(url)["index"]["stale_instances"]
        survivor = next(i for i, c in enumerate(up.components["decode"]) if c["name"] != w["name"])
        before = metric_sum(up.metrics("decode", survivor), "splitserve_worker_requests_total", rpc="generate")
        for i in range(4, 7):  # every request goes to the survivor
            assert complete(url, prompt(i)).status_code == 200
        after = metric_sum(up.metrics("decode", survivor), "splitserve_worker_requests_total", rpc="generate")
        assert after - before == 3
        # the same name comes back (a new process, a new instance id) with nothing cached
        config = up.components["config"]
        port, mport = free_ports(2)
        exe = Path(sys.executable).parent / "splitserve"
        log_path = tmp_path / "restarted-worker.log"
        with open(log_path, "wb") as log:  # its log explains a failure to stop (the child keeps its own copy)
            proc = subprocess.Popen([str(exe), "worker", "--config", str(config), "--role", "both", "--name",
                                     w["name"], "--port", str(port), "--metrics-port", str(mport)],
                                    stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_until(lambda: any(x["name"] == w["name"] and x["healthy"] for x in health(url)["workers"]),
                       timeout=120, what="the restarted worker")
            back = next(x for x in health(url)["workers"] if x["name"] == w["name"])
            assert back["instance_id"] != w["instance_id"] and back["indexed_blocks"] == 0
            assert not health(url)["index"]["stale_instances"]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError("the restarted worker did not stop within 60 s of SIGTERM; its log ends:\n"
                                     + log_path.read_text(errors="replace")[-3000:]) from None
    finally:
        up.stop()


class TestOwnRedis:
    """Bad records written into a Redis of the tests' own, then that Redis killed under load: one cluster, torn
    down after these two."""

    @pytest.fixture(scope="class")
    @classmethod
    def own_redis(cls):
        """Two colocated workers, kv_aware routing, over a redis-server of the test's own: bad records are written
        into it, then the last test kills it and starts it again."""
        redis = RedisServer()
        up = Up("--mode", "colocated", "--decode", "2", "--routing", "kv_aware", "--redis-url", redis.url)
        yield redis, up
        up.stop()
        redis.close()

    def test_bad_records_in_redis_are_rejected_and_counted(self, own_redis):
        redis, up = own_redis
        tag = "{ss:smollm2}"
        redis.cli("xadd", f"ss:v1:{tag}:kv-events", "*", "v", "1", "w", "evil", "k", "stored")
        redis.cli("xadd", f"ss:v1:{tag}:kv-events", "*", "v", "9", "w", "x", "i", "y", "k", "stored", "t", "gpu",
                  "p", "12345678", "h", "123")
        redis.cli("set", f"ss:v1:{tag}:worker:ghost", "{not json", "px", "60000")
        redis.cli("zadd", f"ss:v1:{tag}:workers", "99999999999999", "ghost")
        redis.cli("set", f"ss:v1:{tag}:worker:intruder", '{"v": 1, "name": "intruder", "instance_id": "x", '
                  '"role": "decode", "model": "m", "endpoint": "http://evil.example/", "metrics_url": "", '
                  '"block_size": 16, "kv_capacity_blocks": 1}', "px", "60000")
        redis.cli("zadd", f"ss:v1:{tag}:workers", "99999999999999", "intruder")
        wait_until(lambda: metric_sum(gateway_metrics(up.url), "splitserve_router_index_events_total",
                                      outcome="rejected") >= 2, what="bad events to be counted")
        wait_until(lambda: metric_sum(gateway_metrics(up.url), "splitserve_registry_entries_rejected_total") >= 2,
                   what="bad registry entries to be counted")
        assert {w["name"] for w in health(up.url)["workers"]} == {"decode-0", "decode-1"}  # the cluster's own only
        assert complete(up.url, prompt(1)).status_code == 200

    def test_redis_killed_under_load_and_restarted(self, own_redis):
        """Four clients send requests without pause while Redis is SIGKILLed and later restarted empty on the same
        port: not one request fails (load-only routing meanwhile), and the index rebuilds from the workers."""
        redis, up = own_redis  # after the bad records' test: this one kills the Redis
        url = up.url
        for i in range(3):
            assert complete(url, prompt(i)).status_code == 200
        wait_until(lambda: health(url)["index"]["blocks"] > 0, what="events to reach the index")
        stop = threading.Event()
        statuses: list[int] = []

        def client(k: int) -> None:
            i = 100 * k
            while not stop.is_set():
                r = complete(url, prompt(i))
                statuses.append(r.status_code)
                i += 1

        clients = [threading.Thread(target=client, args=(k,)) for k in range(1, 5)]
        for t in clients:
            t.start()
        try:
            wait_until(lambda: len(statuses) >= 4, timeout=120, what="load")
            redis.stop()  # SIGKILL
            n = len(statuses)
            wait_until(lambda: len(statuses) >= n + 6, timeout=120, what="requests while Redis is gone")
            m = gateway_metrics(url)
            assert metric_sum(m, "splitserve_router_degraded") == 1
            assert metric_sum(m, "splitserve_router_decisions_total", reason="degraded") >= 1
            redis.start()  # the same port, empty
            wait_until(lambda: health(url)["index"]["usable"] and health(url)["index"]["blocks"] > 0, timeout=60,
                       what="the index to repopulate")
            n = len(statuses)
            wait_until(lambda: len(statuses) >= n + 4, timeout=120, what="requests after the restart")
        finally:
            stop.set()
            for t in clients:
                t.join(300)
        assert statuses and set(statuses) == {200}, statuses
        # any call that misses its deadline on a loaded box takes the link down for a second (by design), so
        # the gauge is read once it has settled
        wait_until(lambda: metric_sum(gateway_metrics(url), "splitserve_router_degraded") == 0, timeout=30,
                   what="the gateway to leave degraded mode")


def test_a_session_sticks_for_20_turns(replicas):
    up = replicas
    url = up.components["routers"][-1]["url"]  # the replica that is still alive
    before = [metric_sum(up.metrics("decode", i), "splitserve_worker_requests_total", rpc="generate")
              for i in range(2)]
    history: list[int] = []
    rng = random.Random(3)
    for _ in range(20):
        history += [rng.randrange(1000, 30000) for _ in range(24)]
        r = complete(url, history, user="alice")
        assert r.status_code == 200
    after = [metric_sum(up.metrics("decode", i), "splitserve_worker_requests_total", rpc="generate")
             for i in range(2)]
    served = sorted(a - b for a, b in zip(after, before, strict=True))
    assert served == [0, 20]
    assert metric_sum(gateway_metrics(url), "splitserve_router_decisions_total", reason="session") >= 20


def test_the_same_checks_against_a_redis_cluster():
    cluster = RedisCluster()
    up = Up("--mode", "colocated", "--decode", "2", "--routing", "kv_aware", "--redis-url", cluster.url)
    try:
        url = up.url
        wait_until(lambda: len([w for w in health(url)["workers"] if w["healthy"]]) == 2, what="registry")
        assert complete(url, prompt(0)).status_code == 200  # the shared prefix's first (cold) computation
        wait_until(lambda: health(url)["index"]["blocks"] > 0, what="events through the cluster")
        before = counters(up)
        for i in range(1, 6):
            assert complete(url, prompt(i)).status_code == 200
        assert hit_rate(up, before) >= 0.9  # 400 of 440 tokens each time: the shared prefix
        victim = up.components["decode"][1]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: all(w["name"] != victim["name"] for w in health(url)["workers"]), timeout=15,
                   what="the dead worker to leave")
        assert complete(url, prompt(9)).status_code == 200
    finally:
        up.stop()
        cluster.close()
