"""Tensor and expert parallelism on the CPU: real follower processes joined over gloo (the same code runs
over NCCL on GPUs), checked token for token against one process. Also the pieces: checkpoint slicing into
shards, the step message ranks exchange, and failures (a model that does not split, a rank that dies)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from splitserve.engine.config import ParallelConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.parallel import load_into
from splitserve.engine.step_batch import PrefillChunk, StepBatch

pytestmark = pytest.mark.slow


def make(model_dir, tp: int = 1, ep: bool = False, budget: int = 48) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), dtype="float32", device="cpu", max_model_len=512),
        cache=CacheConfig(kv_cache_memory="16MiB"),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        parallel=ParallelConfig(tp, ep),
    ))


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(384) for _ in range(40)]  # a common prefix: the second wave hits the prefix cache
    return [shared + [rng.randrange(384) for _ in range(rng.randrange(3, 70))] for _ in range(5)]


def run(engine: LLMEngine, ps) -> list[dict]:
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        return engine.generate(ps, sp) + engine.generate(ps[:2], sp)
    finally:
        engine.close()


_BASELINE: dict = {}


@pytest.mark.parametrize("kind,tp,ep", [
    ("qwen3", 2, False),  # vocabulary-parallel LM head
    ("llama3", 2, False),  # tied embeddings: replicated LM head
    ("qwen2", 2, False),  # qkv bias sharded with the heads
    ("qwen3", 4, False),  # 2 KV heads over 4 ranks: KV heads replicated
    ("qwen3_moe", 2, False),  # each expert's intermediate split
    ("qwen3_moe", 2, True),  # expert parallelism: 4 of 8 experts per rank
    ("mixtral", 2, True),
])
def test_sharded_engine_matches_one_process(random_models, kind, tp, ep):
    ps = prompts()
    if kind not in _BASELINE:
        _BASELINE[kind] = run(make(random_models[kind]), ps)
    want = _BASELINE[kind]
    engine = make(random_models[kind], tp, ep)
    assert engine.runner.num_kv_heads < engine.arch.num_kv_heads or tp > engine.arch.num_kv_heads
    followers = list(engine._followers)
    got = run(engine, ps)
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g["logprobs"], w["logprobs"], strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
    assert all(p.poll() == 0 for p in followers)  # stopped cleanly by close()


def test_load_into_slices_full_tensors_into_shards():
    full = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    rows = torch.tensor([1, 2, 4, 5])  # e.g. one rank's part of two fused segments
    local = torch.zeros(4, 4)
    load_into(local, slice(0, 3), full[0:3], {0: rows})  # segment 1: rows 0-2 of the full tensor
    load_into(local, slice(3, 6), full[3:6], {0: rows})  # segment 2
    assert torch.equal(local, full[rows])
    experts = torch.zeros(2, 3, 4)  # experts 2 and 3 of 4 live here
    for e in range(4):
        load_into(experts, e, torch.full((3, 4), float(e)), {0: torch.tensor([2, 3])})
    assert experts[:, 0, 0].tolist() == [2.0, 3.0]
    w13 = torch.zeros(4, 2, 3)  # columns of a 3-d tensor: (expert, slice of dim 1) indexing
    load_into(w13, (1, slice(0, 4)), torch.arange(12.0).view(4, 3), {1: torch.tensor([1, 3])})
    assert w13[1].tolist() == [[3.0, 4.0, 5.0], [9.0, 10.0, 11.0]] and w13[0].abs().sum() == 0


def test_step_message_round_trip_and_rejects_garbage():
    batch = StepBatch([5, 6, 7, 8], [9, 3, 0, 1], [145, 51, 32, 33], [[9], [3, 1, 0, 2]], [10, 4],
                      [PrefillChunk(2, 2, 0, [2])], [0, 1, 3], use_graph=False)
    wire = batch.encode()
    assert StepBatch.decode(wire, num_blocks=16) == batch
    with pytest.raises(ValueError):
        StepBatch.decode(wire[:-1], num_blocks=16)  # truncated
    bad = wire.clone()
    bad[0] = 99  # version
    with pytest.raises(ValueError):
        StepBatch.decode(bad, num_blocks=16)
    with pytest.raises(ValueError):
        StepBatch.decode(wire, num_blocks=4)  # block 9 out of range


def test_model_that_does_not_split_fails_before_any_process_starts(random_models):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        make(random_models["qwen3"], tp=3)
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--prompt", "hi", "--device", "cpu",
                          "--model", str(random_models["qwen3"]), "--tensor-parallel-size", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "not divisible by tensor_parallel_size=3" in out.stderr


def test_a_dead_rank_fails_the_step_instead_of_hanging(random_models):
    engine = make(random_models["qwen3"], tp=2)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[1, 2, 3]], sp)[0]["token_ids"]) == 4
    follower = engine._followers[0]
    os.kill(follower.pid, signal.SIGKILL)
    follower.wait(10)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        engine.generate([[4, 5, 6]], sp)
    assert time.monotonic() - start < 30
    engine.close()


def test_followers_die_with_rank_zero(random_models, tmp_path):
    """Rank 0 killed outright: its followers go too (no orphaned GPU processes)."""
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys\n"
        "from splitserve.engine import CacheConfig, EngineConfig, ModelConfig\n"
        "from splitserve.engine.config import ParallelConfig\n"
        "from splitserve.engine.llm_engine import LLMEngine\n"
        f"e = LLMEngine(EngineConfig(model=ModelConfig({str(random_models['qwen3'])!r}, device='cpu',"
        " max_model_len=256), cache=CacheConfig(kv_cache_memory='8MiB'), parallel=ParallelConfig(2)))\n"
        "print(e._followers[0].pid, flush=True)\n"
        "import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    follower_pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(follower_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail("the follower outlived rank 0")
