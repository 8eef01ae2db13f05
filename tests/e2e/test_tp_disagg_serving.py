"""Disaggregated serving between tensor-parallel workers, end to end on the CPU: real worker processes (each
rank its own process, gloo), real gRPC, KV streamed over TCP shard by shard, checked token for token against
the colocated single process.

A small Qwen3-MoE (4 query heads, 2 KV heads, a dense layer and MoE layers): prefill TP=1/2 into decode TP=1
and TP=2 with expert parallelism (all four pairs), and TP=4 on either side, where the 2 KV heads are
replicated (sent once, copied between the decode ranks sharing them). Then a prefill rank is killed:
requests fall back to local prefill on the decode side, with the same tokens, and nothing hangs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

import grpc
import pytest
from support.models import make_random_model
from support.serving import metric_sum, scrape

from splitserve.common.proc import free_ports
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.protocol import splitserve_pb2_grpc as pb_grpc
from splitserve.common.protocol.convert import params_to_pb
from splitserve.common.sampling import SamplingParams
from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

START_S = 180.0
MAX_TOKENS = 6
BUDGET = 32  # tokens per step: prompts of 40-90 tokens stream in 2-3 chunks


class Worker:
    def __init__(self, role: str, model: Path, tp: int, *extra: str) -> None:
        self.port, self.mport = free_ports(2)
        self.endpoint = f"127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "splitserve"
        cmd = [str(exe), "worker", "--role", role, "--model", str(model), "--device", "cpu", "--dtype", "float32",
               "--max-model-len", "512", "--tensor-parallel-size", str(tp), "--kv-cache-memory", "8MiB",
               "--max-num-batched-tokens", str(BUDGET), "--threads", "1", "--kv-transport", "tcp",
               "--port", str(self.port), "--metrics-port", str(self.mport), "--transfer-timeout", "20", *extra]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.log: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip())

    def tail(self) -> str:
        return "\n".join(self.log)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.mport}/readyz", timeout=2) as r:
                    if json.loads(r.read()).get("ready"):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("worker not ready")

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(scrape(f"http://127.0.0.1:{self.mport}"), name, **labels)

    def followers(self) -> list[int]:
        out = subprocess.run(["pgrep", "-f", "--parent", str(self.proc.pid), "splitserve.engine.parallel_worker"],
                             capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start(*workers: Worker) -> None:
    deadline = time.monotonic() + START_S
    try:
        for w in workers:
            w.wait_ready(deadline)
    except BaseException:
        for w in workers:
            w.stop()
        raise


def generate(decode: Worker, prefill: Worker | None, prompt: list[int], rid: str) -> tuple[list[int], bool]:
    """(tokens, whether the prompt's KV came from the prefill worker)."""
    with grpc.insecure_channel(decode.endpoint) as channel:
        stub = pb_grpc.WorkerStub(channel)
        params = params_to_pb(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        tokens, remote = [], False
        for out in stub.Generate(pb.GenerateRequest(protocol_version=PROTOCOL_VERSION, request_id=rid,
                                                    prompt_token_ids=prompt, params=params,
                                                    prefill_worker=prefill.endpoint if prefill else ""),
                                 timeout=60):
            assert not out.error, out.error
            tokens += list(out.token_ids)
            remote = remote or out.remote_prefill
        return tokens, remote


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(384) for _ in range(32)]  # the second prompt hits the decode side's prefix cache
    return [shared + [rng.randrange(384) for _ in range(n)] for n in (40, 58)] + \
           [[rng.randrange(384) for _ in range(rng.randrange(20, 90))]]


def colocated(model: Path, ps: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(model), dtype="float32", device="cpu", max_model_len=512),
                                    cache=CacheConfig(kv_cache_memory="8MiB"),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET)))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [r["token_ids"] for r in engine.generate(ps, sp)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Prefill workers at TP=1, 2, 4 and decode workers at TP=1, 2 (expert-parallel), 4, started together."""
    model = make_random_model("qwen3_moe", tmp_path_factory.mktemp("tp_disagg") / "qwen3_moe")
    prefill = {tp: Worker("prefill", model, tp) for tp in (1, 2, 4)}
    peers = ("--prefill-peers", ",".join(w.endpoint for w in prefill.values()), "--disagg-threshold", "16")
    decode = {1: Worker("decode", model, 1, *peers), 2: Worker("decode", model, 2, "--expert-parallel", *peers),
              4: Worker("decode", model, 4, *peers)}
    workers = [*prefill.values(), *decode.values()]
    start(*workers)
    yield model, prefill, decode
    for w in workers:
        w.stop()


def check_pairs(pairs: list[tuple[Worker, Worker]], model: Path, seed: int, tag: str) -> None:
    """Fresh prompts for each pair (a decode worker's prefix cache would keep earlier ones local)."""
    ps = [prompts(seed + i) for i in range(len(pairs))]
    want = colocated(model, [p for group in ps for p in group])
    for i, (pre, dec) in enumerate(pairs):
        for j, p in enumerate(ps[i]):
            tokens, remote = generate(dec, pre, p, f"{tag}-{i}-{j}")
            assert remote, f"{tag} pair {i} prompt {j}: fell back to local prefill\n{pre.tail()}\n{dec.tail()}"
            assert tokens == want[i * len(ps[i]) + j], f"{tag} pair {i} prompt {j}"


def test_tp_pairs_match_the_colocated_process(cluster):
    """1->1, 1->2 (EP), 2->1, 2->2 (EP), and with 2 KV heads over 4 ranks (replicated): 4->2, 2->4, 4->4."""
    model, p, d = cluster
    check_pairs([(p[1], d[1]), (p[1], d[2]), (p[2], d[1]), (p[2], d[2]), (p[4], d[2]), (p[2], d[4]), (p[4], d[4])],
                model, 10, "tp")


def test_a_killed_prefill_rank_falls_back_to_local_prefill(cluster):
    model, p, d = cluster
    ps = prompts(30)
    fresh = prompts(33)[2]  # for after the kill: one the decode worker has not cached
    want = colocated(model, ps + [fresh])
    followers = p[2].followers()
    assert len(followers) == 1
    before = d[1].metric("splitserve_local_prefill_total", reason="fallback")
    os.kill(followers[0], signal.SIGKILL)  # prefill rank 1 dies: that prefill worker cannot compute any more
    for j, prompt in enumerate(ps):  # each call is bounded (gRPC timeout 60 s > the 20 s transfer deadline)
        tokens, _ = generate(d[1], p[2], prompt, f"killed-{j}")
        assert tokens == want[j], f"{tokens} {want[j]}\n{p[2].tail()}\n{d[1].tail()}"
    assert d[1].metric("splitserve_local_prefill_total", reason="fallback") - before == len(ps)
    tokens, remote = generate(d[1], p[1], fresh, "after")  # a healthy prefill worker still streams
    assert remote and tokens == want[-1]
