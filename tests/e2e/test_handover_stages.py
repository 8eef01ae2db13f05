"""The handover's stage timeline as metrics, end to end: a disaggregated `splitserve up` (real processes, real
gRPC and KV transfer, SmolLM2 on the CPU) serves a few remotely prefilled requests, and each stage of
`splitserve_handover_stage_seconds` (decode worker) and `splitserve_prefill_stage_seconds` (prefill worker) is
observed once per request, with times that add up within what the client measured."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from support.serving import Up, metric_sum, scrape

from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.decode_worker.metrics import HANDOVER_STAGES
from splitserve.prefill_worker.metrics import PREFILL_STAGES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
THRESHOLD = 32  # prompt tokens from which the decode worker asks the prefill worker
NUM_REQUESTS = 3
OUTPUT_TOKENS = 4


@pytest.fixture(scope="module")
def disagg():
    up = Up("--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--disagg-threshold", str(THRESHOLD))
    yield up
    assert up.stop() == 0


def stage_totals(metrics: dict[str, float], name: str, stages: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(count, sum in seconds) of each stage's histogram."""
    return {s: (metric_sum(metrics, f"{name}_count", stage=s), metric_sum(metrics, f"{name}_sum", stage=s))
            for s in stages}


def delta(after: dict, before: dict) -> dict[str, tuple[float, float]]:
    return {s: (after[s][0] - before[s][0], after[s][1] - before[s][1]) for s in after}


def complete(up: Up, prompt: list[int]) -> float:
    """One completion of OUTPUT_TOKENS tokens; the seconds it took, as the client saw them."""
    start = time.monotonic()
    r = httpx.post(up.url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)
    took = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == OUTPUT_TOKENS
    return took


def test_each_stage_observed_once_per_remote_prefill_and_within_its_latency(disagg):
    decode_name, prefill_name = "splitserve_handover_stage_seconds", "splitserve_prefill_stage_seconds"
    dec_before = stage_totals(disagg.metrics("decode"), decode_name, HANDOVER_STAGES)
    pre_before = stage_totals(disagg.metrics("prefill"), prefill_name, PREFILL_STAGES)
    remote_before = metric_sum(disagg.metrics("decode"), "splitserve_remote_prefill_total", outcome="ok")

    rng = random.Random(0)  # fresh prompts: nothing of them is cached on either worker
    latencies = [complete(disagg, [rng.randrange(100, 40000) for _ in range(THRESHOLD * 2)])
                 for _ in range(NUM_REQUESTS)]
    complete(disagg, [11, 12, 13])  # under the threshold: prefilled on the decode worker, no handover

    dec_after, pre_after = disagg.metrics("decode"), disagg.metrics("prefill")
    assert metric_sum(dec_after, "splitserve_remote_prefill_total", outcome="ok") - remote_before == NUM_REQUESTS
    dec = delta(stage_totals(dec_after, decode_name, HANDOVER_STAGES), dec_before)
    pre = delta(stage_totals(pre_after, prefill_name, PREFILL_STAGES), pre_before)
    assert {s: c for s, (c, _) in dec.items()} == dict.fromkeys(HANDOVER_STAGES, NUM_REQUESTS)
    assert {s: c for s, (c, _) in pre.items()} == dict.fromkeys(PREFILL_STAGES, NUM_REQUESTS)
    assert all(seconds >= 0 for _, seconds in (*dec.values(), *pre.values())), (dec, pre)
    # the decode worker's stages lie within each request's latency; the prefill worker's within its RPC, which
    # went out as the reservation began (the ticket followed it)
    assert sum(seconds for _, seconds in dec.values()) <= sum(latencies), (dec, latencies)
    rpc = dec["reserve"][1] + dec["ticket"][1] + dec["prefill"][1]
    assert sum(seconds for _, seconds in pre.values()) <= rpc, (pre, dec)
    assert pre["compute"][1] > 0 and dec["prefill"][1] > 0
    # each histogram's buckets count every observation
    for name, stages in ((decode_name, HANDOVER_STAGES), (prefill_name, PREFILL_STAGES)):
        metrics = dec_after if name == decode_name else pre_after
        for s in stages:
            assert metric_sum(metrics, f"{name}_bucket", stage=s, le="+Inf") == metric_sum(metrics, f"{name}_count",
                                                                                           stage=s)


def test_first_token_before_admission_and_a_client_leaving_after_it_leaves_no_blocks(disagg):
    """The decode worker sends the first token on once the KV landed, before its engine admits the request; a
    client that hangs up right after that token leaves no request and no block behind on the decode worker."""
    rng = random.Random(1)
    body = {"model": "smollm2", "prompt": [rng.randrange(100, 40000) for _ in range(THRESHOLD * 2)],
            "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    first_before = metric_sum(disagg.metrics("decode"), "splitserve_handover_stage_seconds_count",
                              stage="first_token")
    for _ in range(3):
        with httpx.stream("POST", disagg.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token: hang up
        body["prompt"] = body["prompt"][1:] + [rng.randrange(100, 40000)]
    deadline = time.monotonic() + 60
    while True:
        metrics = disagg.metrics("decode")
        busy = (metric_sum(metrics, "splitserve_worker_running_requests"),
                metric_sum(metrics, "splitserve_worker_waiting_requests"),
                metric_sum(metrics, "splitserve_worker_kv_blocks_used"))
        if busy == (0, 0, 0):
            break
        assert time.monotonic() < deadline, f"decode worker still holds (running, waiting, blocks) {busy}"
        time.sleep(0.2)
    assert metric_sum(metrics, "splitserve_handover_stage_seconds_count", stage="first_token") - first_before == 3


def test_a_prefill_call_early_or_not_refuses_bad_streams_and_serves_on(disagg):
    """PrefillEarly on the real prefill worker: a stream that does not bring the request then its ticket is
    refused as INVALID_ARGUMENT (nothing crashes, nothing waits), and one given up before its ticket leaves no
    request running; remote prefills go on through the gateway."""
    endpoint = disagg.components["prefill"][0]["grpc"]
    request = pb.PrefillRequest(protocol_version=PROTOCOL_VERSION, request_id="fz", prompt_token_ids=list(range(100, 164)),
                                params=pb.SamplingParams(max_tokens=1, top_p=1.0))
    req = pb.PrefillStreamMessage(request=request).SerializeToString()
    ticket = pb.PrefillStreamMessage(ticket=b"not a ticket").SerializeToString()
    bad_streams = {
        "no message": [],
        "a ticket first": [ticket],
        "undecodable": [b"\xff" * 9],
        "a bad ticket": [req, ticket],
        "a request twice": [req, req],
        "an undecodable ticket": [req, b"\x0a\xff\xff"],
        "no ticket": [req],
    }
    with grpc.insecure_channel(endpoint) as channel:
        early = channel.stream_unary("/splitserve.v1.Worker/PrefillEarly")
        for name, messages in bad_streams.items():
            with pytest.raises(grpc.RpcError) as e:
                early(iter(messages), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.code(), e.value.details())

        def hold():  # the request, then nothing: the caller gives up before its ticket
            yield req
            time.sleep(5)

        future = early.future(hold(), timeout=60)
        time.sleep(1)
        future.cancel()
    deadline = time.monotonic() + 30
    while (running := disagg.stats("prefill")["num_running"] + disagg.stats("prefill")["num_waiting"]) != 0:
        assert time.monotonic() < deadline, f"the prefill worker still runs {running} requests"
        time.sleep(0.2)
    before = metric_sum(disagg.metrics("decode"), "splitserve_remote_prefill_total", outcome="ok")
    rng = random.Random(2)
    complete(disagg, [rng.randrange(100, 40000) for _ in range(THRESHOLD * 2)])
    assert metric_sum(disagg.metrics("decode"), "splitserve_remote_prefill_total", outcome="ok") == before + 1


def test_stage_series_stay_on_their_roles(disagg):
    """Each worker lists only its own role's stages (all of them, observed or not); the gateway lists neither."""
    decode, prefill, gateway = disagg.metrics("decode"), disagg.metrics("prefill"), scrape(disagg.url)
    assert all(f'splitserve_handover_stage_seconds_count{{stage="{s}"}}' in decode for s in HANDOVER_STAGES)
    assert all(f'splitserve_prefill_stage_seconds_count{{stage="{s}"}}' in prefill for s in PREFILL_STAGES)
    assert not any(k.startswith("splitserve_prefill_stage") for k in decode)
    assert not any(k.startswith("splitserve_handover_stage") for k in prefill)
    assert not any(k.startswith(("splitserve_prefill_stage", "splitserve_handover_stage")) for k in gateway)


def load_harness():
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_stage_means_from_two_scrapes():
    """benchmarks/serving_gpu.py's handover_stages_ms (the harness's stage_means_ms): per-stage means between two
    scrapes, and the RPC's rest."""
    sg = load_harness()

    def totals(n: float, total_ms: float) -> dict[str, float]:
        """A scrape where each stage was observed n times, stage i for (i + 1) * total_ms in all."""
        out = {}
        for role, stages in (("decode", HANDOVER_STAGES), ("prefill", PREFILL_STAGES)):
            name = sg.STAGE_METRICS[role]
            for i, s in enumerate(stages):
                out[f'{name}_count{{stage="{s}"}}'] = n
                out[f'{name}_sum{{stage="{s}"}}'] = total_ms * (i + 1) / 1e3
        return out

    means = sg.stage_means_ms(totals(2, 2.0), totals(6, 10.0))  # 4 requests, stage i (i + 1) * 2 ms each
    assert means["requests"] == 4
    assert means["decode"] == {s: 2.0 * (i + 1) for i, s in enumerate(HANDOVER_STAGES)}
    assert means["prefill"] == {s: 2.0 * (i + 1) for i, s in enumerate(PREFILL_STAGES)}
    dec = means["decode"]
    assert means["rpc_hops"] == dec["reserve"] + dec["ticket"] + dec["prefill"] - sum(means["prefill"].values())
    late = sg.stage_means_ms(totals(2, 2.0), totals(6, 10.0), early=False)  # the call out after the reservation
    assert late["rpc_hops"] == dec["prefill"] - sum(means["prefill"].values())
    assert sg.stage_means_ms(totals(2, 2.0), totals(2, 2.0))["decode"] == dict.fromkeys(HANDOVER_STAGES)


@pytest.mark.parametrize("argv,message", [
    (["--parts", "handover", "--moe-share-gpu"], "--moe-share-gpu applies to the moe part only"),
    (["--parts", "moe", "--moe-share-gpu", "--moe-decode-tp", "1"], "--moe-decode-tp 1 shares nothing"),
    (["--parts", "moe", "--moe-decode-kv-cache-memory", "lots"], "--moe-decode-kv-cache-memory: 'lots' is not"),
    (["--parts", "moe,nope"], "--parts: unknown nope"),
])
def test_benchmark_refuses_bad_combinations_in_one_line(argv, message):
    res = subprocess.run([sys.executable, "benchmarks/serving_gpu.py", "--device", "cpu", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("serving_gpu: ") and message in line, line
