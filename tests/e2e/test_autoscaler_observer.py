"""The autoscaler's observer against a real redis-server (the registry, written with the workers' own lease
script) and a tiny HTTP server serving hand-written Prometheus text as a gateway's and workers' /metrics."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from support.metrics_server import MetricsServer
from support.redis_server import RedisServer

from splitserve.autoscaler.observer import Observer, histogram_quantile, parse_metrics
from splitserve.common.redis_wire import LEASE_SCRIPT, Keys, RegistryEntry

pytestmark = pytest.mark.slow

MODEL = "smollm2"


@pytest.fixture
def env() -> Iterator[tuple[RedisServer, MetricsServer, redis.Redis]]:
    server, metrics = RedisServer(), MetricsServer()
    client = redis.Redis.from_url(server.url)
    try:
        yield server, metrics, client
    finally:
        client.close()
        metrics.close()
        server.close()


def register(r: redis.Redis, entry: RegistryEntry, lease_ms: int = 30_000) -> None:
    keys = Keys(MODEL)
    r.eval(LEASE_SCRIPT, 2, keys.worker(entry.name), keys.workers, entry.name, entry.encode(), lease_ms)


def entry(name: str, role: str, port: int, metrics_url: str, **load: int | bool) -> RegistryEntry:
    return RegistryEntry(name, f"{name}-i1", role, MODEL, f"127.0.0.1:{port}", metrics_url, 16, 1000, **load)


def gateway_page(requests: int, prompt: int, generated: int, ttft: dict[str, int], itl: dict[str, int]) -> str:
    def hist(name: str, counts: dict[str, int]) -> str:
        lines = [f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{le}"}} {n}' for le, n in counts.items()]
        lines += [f"{name}_count {list(counts.values())[-1]}", f"{name}_sum 1.0"]
        return "\n".join(lines)

    return "\n".join([
        "# TYPE splitserve_requests counter",
        f'splitserve_requests_total{{endpoint="chat",status="200"}} {requests}',
        'splitserve_requests_total{endpoint="chat",status="429"} 7',
        "# TYPE splitserve_prompt_tokens counter", f"splitserve_prompt_tokens_total {prompt}",
        "# TYPE splitserve_generation_tokens counter", f"splitserve_generation_tokens_total {generated}",
        hist("splitserve_time_to_first_token_seconds", ttft),
        hist("splitserve_inter_token_latency_seconds", itl),
        "",
    ])


def prefill_page(ok: int) -> str:
    return ("# TYPE splitserve_worker_requests counter\n"
            f'splitserve_worker_requests_total{{rpc="prefill",status="ok"}} {ok}\n')


def decode_page(remote: int, local: int) -> str:
    return ("# TYPE splitserve_remote_prefill counter\n"
            f'splitserve_remote_prefill_total{{outcome="ok"}} {remote}\n'
            "# TYPE splitserve_local_prefill counter\n"
            f'splitserve_local_prefill_total{{reason="short"}} {local}\n')


def test_histogram_quantile_matches_promql():
    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 40 / 50)
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 5.0)]) == 1.0  # in +Inf: the highest bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_parse_rejects_negative_and_non_numbers():
    assert parse_metrics("# TYPE splitserve_x gauge\nsplitserve_x 3\nother_y -1\n") == {("splitserve_x", ()): 3.0}
    with pytest.raises(ValueError):
        parse_metrics("# TYPE splitserve_x gauge\nsplitserve_x -1\n")
    with pytest.raises(ValueError):
        parse_metrics("splitserve_x{ 3\n")


def test_observation_from_registry_and_metrics_over_a_window(env):
    server, metrics, r = env
    clock = [100.0]
    gw = f"{metrics.url}/gw"
    register(r, entry("prefill-0", "prefill", 5001, f"{metrics.url}/p0", num_waiting=3, waiting_prefill_tokens=900,
                      num_running=1, kv_blocks_used=100))
    register(r, entry("prefill-1", "prefill", 5002, f"{metrics.url}/p1", draining=True))
    register(r, entry("decode-0", "decode", 5003, f"{metrics.url}/d0", num_running=4, kv_blocks_used=500))
    metrics.pages.update({
        "/gw/metrics": gateway_page(10, 4000, 320, {"0.5": 5, "1.0": 10, "2.5": 10, "+Inf": 10},
                                    {"0.05": 100, "0.1": 100, "+Inf": 100}),
        "/p0/metrics": prefill_page(8), "/p1/metrics": prefill_page(0), "/d0/metrics": decode_page(8, 2),
    })
    obs = Observer(server.url, MODEL, [gw], clock=lambda: clock[0])
    first = obs.observe(expected={"prefill": 2, "decode": 1})
    assert first.window_seconds == 0.0 and first.prefill.arrival_rate == 0.0  # no window yet
    p = first.prefill
    assert (p.replicas_ready, p.replicas_draining, p.replicas_starting) == (1, 1, 1)
    assert (p.num_waiting, p.waiting_prefill_tokens, p.num_running, p.kv_usage) == (3, 900, 1, 0.1)
    assert (first.decode.replicas_ready, first.decode.num_running, first.decode.kv_usage) == (1, 4, 0.5)
    assert first.decode.idle_replicas == 0 and p.idle_replicas == 0

    # 10 s later: 20 more answered requests (4 of them remote-prefilled per 5), 8000 prompt tokens, 640 generated
    clock[0] = 110.0
    metrics.pages.update({
        "/gw/metrics": gateway_page(30, 12000, 960, {"0.5": 5 + 2, "1.0": 10 + 10, "2.5": 30, "+Inf": 30},
                                    {"0.05": 100 + 500, "0.1": 700, "+Inf": 700}),
        "/p0/metrics": prefill_page(24), "/d0/metrics": decode_page(24, 6),
    })
    o = obs.observe(expected={"prefill": 2, "decode": 1})
    assert o.window_seconds == 10.0
    assert o.decode.arrival_rate == pytest.approx(2.0)  # 429s are not answered requests
    assert o.decode.output_tokens_per_s == pytest.approx(64.0)
    assert o.decode.mean_output_tokens == pytest.approx(32.0) and o.decode.mean_input_tokens == pytest.approx(400.0)
    assert o.prefill.arrival_rate == pytest.approx(1.6)
    assert o.prefill.input_tokens_per_s == pytest.approx(800.0 * 0.8)  # the remote share of the prompt tokens
    assert o.decode.input_tokens_per_s == pytest.approx(800.0 * 0.2)
    # TTFT: window buckets 0.5:2, 1.0:10, 2.5:20 → p50 at rank 10 = 1.0; p90 at rank 18 in (1.0, 2.5]
    assert o.prefill.ttft.count == 20 and o.prefill.ttft.p50 == pytest.approx(1.0)
    assert o.prefill.ttft.p90 == pytest.approx(1.0 + 1.5 * 8 / 10)
    assert o.decode.itl.count == 600 and o.decode.itl.p50 == pytest.approx(0.05 * 300 / 500)
    assert obs.errors == {}


def test_bad_scrapes_and_entries_are_counted_and_skipped(env):
    server, metrics, r = env
    clock = [0.0]
    register(r, entry("decode-0", "decode", 5003, f"{metrics.url}/d0", num_running=2))
    register(r, entry("decode-1", "decode", 5004, f"{metrics.url}/missing"))
    keys = Keys(MODEL)
    r.eval(LEASE_SCRIPT, 2, keys.worker("bad"), keys.workers, "bad", b'{"v": 1, "name": "bad"}', 30_000)
    r.eval(LEASE_SCRIPT, 2, keys.worker("liar"), keys.workers, "liar",
           entry("someone-else", "decode", 5005, "").encode(), 30_000)
    metrics.pages["/gw/metrics"] = "splitserve_requests_total{ 1\n"  # does not parse
    metrics.pages["/d0/metrics"] = decode_page(1, 1)
    obs = Observer(server.url, MODEL, [f"{metrics.url}/gw", "http://127.0.0.1:1"], clock=lambda: clock[0],
                   timeout_s=1.0)
    clock[0] = 5.0
    o = obs.observe()
    assert o.decode.replicas_ready == 2 and o.decode.num_running == 2
    assert obs.errors == {"registry_entry": 2, "gateway_metrics": 2, "worker_metrics": 1}
    assert o.decode.ttft.count == 0 and o.decode.arrival_rate == 0.0

    server.stop()  # Redis gone: the last registry view is kept, the read is counted
    o = obs.observe()
    assert o.decode.replicas_ready == 2 and obs.errors["redis"] == 1


def test_expired_leases_are_not_members(env):
    server, metrics, r = env
    register(r, entry("decode-0", "decode", 5003, ""), lease_ms=-1000)
    register(r, entry("decode-1", "decode", 5004, ""))
    o = Observer(server.url, MODEL, []).observe(expected={"decode": 3})
    assert (o.decode.replicas_ready, o.decode.replicas_starting) == (1, 2)


def test_a_restarted_gateway_counts_from_zero(env):
    """A counter that went down is a process that restarted: the window counts its new value, never a negative
    rate."""
    server, metrics, r = env
    clock = [0.0]
    page = {"0.5": 1, "+Inf": 1}
    metrics.pages["/gw/metrics"] = gateway_page(100, 10_000, 1000, page, page)
    obs = Observer(server.url, MODEL, [f"{metrics.url}/gw"], clock=lambda: clock[0])
    obs.observe()
    clock[0] = 10.0
    metrics.pages["/gw/metrics"] = gateway_page(5, 2000, 50, page, page)  # restarted, then 5 answered
    o = obs.observe()
    assert o.decode.arrival_rate == pytest.approx(0.5) and o.decode.output_tokens_per_s == pytest.approx(5.0)
    assert o.decode.mean_input_tokens == pytest.approx(400.0)
