"""A role flip for real: `splitserve up` with one prefill and two decode workers (SmolLM2 on this CPU, the bundled
Redis), 8 seeded streams over the two decode workers, and `splitserve flip` moving one decode worker to prefill
while its 4 streams run. The command exits 0 once the gateway sees the worker serving prefill (its seconds are
printed: the 5-s goal is benchmarks/role_flip.py's); every stream completes with the text of its undisturbed run
(its streams moved to the other decode worker, which continues them: seeded draws are keyed by output
position, and batch-invariant workers compute each token the same in any batch); afterwards /health lists the worker as prefill and it computes prompts (its prefill counter rises).
The command's one-line errors come from the same cluster."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from support.serving import Up, metric_sum, scrape

from e2e.test_migration import Stream, assert_undisturbed, bodies, migrations, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SPLITSERVE = Path(sys.executable).parent / "splitserve"
CLUSTER = """apiVersion: splitserve.dev/v1alpha1
kind: SplitServeCluster
metadata: {name: flips}
spec:
  model: {name: smollm2, dtype: float32, device: cpu, maxModelLen: 1024}
  mode: disaggregated
  redis: {mode: bundled}
  prefill: {replicas: 1, engine: {kvCacheMemory: 128MiB}}
  # the streams' prompts and outputs stay under the threshold: each decode worker computes its own (a moved
  # stream's too); the long prompts sent after the flip go to a prefill worker
  decode: {replicas: 2, disaggThreshold: 96, engine: {kvCacheMemory: 256MiB, batchInvariant: true}}
  router: {policy: round_robin, stallSeconds: 30}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("flips") / "cluster.yaml"
    cfg.write_text(CLUSTER)
    up = Up("-f", str(cfg), timeout=420)
    yield up
    assert up.stop() == 0


def health(up: Up) -> dict:
    with urllib.request.urlopen(up.url + "/health", timeout=10) as r:
        return json.loads(r.read())


def flip(up: Up, worker: str, role: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SPLITSERVE), "flip", "--url", up.url, "--worker", worker, "--to", role, *extra],
                          capture_output=True, text=True, timeout=180)


def test_a_decode_worker_flips_to_prefill_under_4_streams_and_loses_none(cluster):
    up = cluster
    requests = bodies(8, sampled=8, prefix="Flip. ")
    undisturbed = asyncio.run(run(up.url, requests))
    assert all(s.finish == "length" and not s.errors for s in undisturbed)
    flipped: dict = {}

    def flip_the_busier() -> None:  # on the event loop's thread: the command runs beside it
        workers = [w for w in health(up)["workers"] if w["role"] == "decode"]
        victim = max(workers, key=lambda w: w["outstanding"])
        flipped.update(name=victim["name"], streams=victim["outstanding"])

        def command() -> None:
            t0 = time.monotonic()
            flipped["result"] = flip(up, victim["name"], "prefill", "--drain-seconds", "0")
            flipped["wall_s"] = time.monotonic() - t0

        flipped["thread"] = threading.Thread(target=command)
        flipped["thread"].start()

    moved: list[Stream] = asyncio.run(run(up.url, requests, when_all_have=3, then=flip_the_busier))
    flipped["thread"].join(200)
    result = flipped["result"]
    assert result.returncode == 0, result.stderr
    said = re.search(r"serves prefill \(was decode\) after ([0-9.]+) s; (\d+) streams moved", result.stdout)
    assert said, result.stdout
    print(f"\nflip of {flipped['name']} with {flipped['streams']} streams running: {float(said[1]):.2f} s at the "
          f"gateway, {flipped['wall_s']:.2f} s for the command; {said[2]} streams moved")
    assert flipped["streams"] >= 4  # round robin: 4 of the 8 on each decode worker
    assert flipped["wall_s"] < 120  # generous on a busy 2-core box; the 5-s goal is the benchmark's

    # no stream lost: each moved to the other decode worker and completed as if undisturbed
    assert_undisturbed(moved, undisturbed)
    assert int(said[2]) >= 1 and migrations(up, reason="drain", outcome="resumed") >= 1

    # the worker serves prefill now, in /health and in its own metrics
    view = {w["name"]: w for w in health(up)["workers"]}
    me = view[flipped["name"]]
    assert me["role"] == "prefill" and me["healthy"] and not me["draining"], me
    assert sum(w["role"] == "decode" for w in view.values()) == 1
    metrics_url = next(c["metrics"] for c in up.components["decode"] if c["name"] == flipped["name"])
    mine = scrape(metrics_url)
    assert metric_sum(mine, "splitserve_role_flips_total", source="decode", target="prefill", outcome="ok") == 1
    assert metric_sum(mine, "splitserve_role_flip_seconds_count", target="prefill") == 1
    before = metric_sum(mine, "splitserve_worker_requests_total", rpc="prefill", status="ok")

    # long prompts go to a prefill worker (round robin over the two): some of them to the flipped one
    long_prompt = "Write about rivers. " * 40  # ~200 tokens: over the decode workers' disaggThreshold
    for i in range(4):
        body = json.dumps({"model": "smollm2", "prompt": f"{i} {long_prompt}", "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(up.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=240) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 4
    after = metric_sum(scrape(metrics_url), "splitserve_worker_requests_total", rpc="prefill", status="ok")
    assert after > before, (before, after)


def test_flip_errors_are_one_line(cluster):
    """Unknown worker, a worker already in that role: exit 1, one line naming what is wrong."""
    up = cluster
    unknown = flip(up, "no-such-worker", "decode")
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert "no-such-worker" in unknown.stderr and "no such worker" in unknown.stderr
    prefill = next(w["name"] for w in health(up)["workers"] if w["role"] == "prefill")
    same = flip(up, prefill, "prefill")
    assert same.returncode == 1 and "serves prefill already" in same.stderr and same.stderr.count("\n") == 1
    gone = subprocess.run([str(SPLITSERVE), "flip", "--url", "http://127.0.0.1:9", "--worker", "x", "--to", "decode"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "no answer from the gateway" in gone.stderr and gone.stderr.count("\n") == 1
