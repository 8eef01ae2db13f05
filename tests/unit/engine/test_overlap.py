"""The overlapped decode step: a step of greedy decodes launches before the previous step's tokens are read.

On CUDA this hides the host's scheduling and output work behind the device; on CPU the launch runs the whole
step, so these tests turn it on by hand to check the bookkeeping (pending tokens, stops, aborts, preemption,
block caching) against the same engine stepping synchronously, on the real SmolLM2 weights.
"""

from __future__ import annotations

import pytest
from support.helpers import greedy, make_engine

from splitserve.common.sampling import SamplingParams
from splitserve.engine.request import PENDING_TOKEN

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine(smollm2_dir, kv_memory="16MiB", max_model_len=256, block_size=16)


def _ids(engine, texts):
    return [engine.tokenizer.encode(t) for t in texts]


def _run(engine, overlap: bool, jobs, on_step=None) -> tuple[dict, dict]:
    """Run (id, prompt ids, params) jobs to the end; {id: (tokens, finish_reason, stop_reason, n_out)} and counts."""
    engine.overlap = overlap
    launched = {"overlapped": 0}
    real_launch = engine.runner.launch

    def counting_launch(order, prev=None):
        launched["overlapped"] += 1
        return real_launch(order, prev)

    engine.runner.launch = counting_launch
    try:
        for rid, prompt, params in jobs:
            engine.add_request(rid, prompt, params)
        got: dict[str, list] = {rid: [[], None, None, 0] for rid, _, _ in jobs}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                assert PENDING_TOKEN not in out.new_token_ids
                g = got.setdefault(out.request_id, [[], None, None, 0])
                g[0] += out.new_token_ids
                if out.finished:
                    g[1], g[2], g[3] = out.finish_reason, out.stop_reason, out.num_output_tokens
            steps += 1
            if on_step is not None:
                on_step(engine, steps)
            assert steps < 2000
    finally:
        engine.runner.launch = real_launch
        engine.overlap = False
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert not engine.scheduler.requests
    return {k: (v[0], v[1], v[2], v[3]) for k, v in got.items()}, launched


def _cached_hashes(engine) -> set[int]:
    return set(engine.scheduler.pool.cached)


def test_overlapped_steps_give_the_same_tokens_stops_and_cache(engine):
    ids = _ids(engine, PROMPTS)
    jobs = [
        ("a", ids[0], greedy(24)),
        ("b", ids[1], greedy(40)),
        ("c", ids[2], greedy(7)),
        ("d", ids[3], greedy(33, ignore_eos=True)),
        ("e", ids[4], greedy(1)),
    ]
    engine.scheduler.pool.reset_prefix_cache()
    ref, _ = _run(engine, False, jobs)
    ref_cache = _cached_hashes(engine)
    engine.scheduler.pool.reset_prefix_cache()
    got, launched = _run(engine, True, [(f"o{r}", p, sp) for r, p, sp in jobs])
    assert launched["overlapped"] > 20  # the decodes really went through the overlapped path
    assert {k[1:]: v for k, v in got.items()} == ref
    assert _cached_hashes(engine) == ref_cache  # the prefix cache never saw a pending token
    for (rid, _, sp) in jobs:
        assert ref[rid][3] == len(ref[rid][0]) <= sp.max_tokens


def test_stop_token_and_eos_end_at_the_same_token(engine):
    ids = _ids(engine, PROMPTS[:3])
    ref, _ = _run(engine, False, [(f"r{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(ids)])
    # stop each on a token it produces mid-way: the overlapped step has already launched the one after it
    jobs = []
    for i, p in enumerate(ids):
        toks = ref[f"r{i}"][0]
        jobs.append((f"s{i}", p, greedy(30, stop_token_ids=[toks[5 + 3 * i]])))
    want, _ = _run(engine, False, jobs)
    got, launched = _run(engine, True, [(f"o{r}", p, sp) for r, p, sp in jobs])
    assert launched["overlapped"] > 5
    assert {k[1:]: v for k, v in got.items()} == want
    for i in range(3):
        tokens, reason, stop, _ = got[f"os{i}"]
        full = ref[f"r{i}"][0]
        assert reason == "stop" and tokens[-1] == stop and len(tokens) == full.index(stop) + 1


def test_abort_and_arrivals_while_a_step_is_in_flight(engine):
    ids = _ids(engine, PROMPTS)
    jobs = [(f"x{i}", p, greedy(20, ignore_eos=True)) for i, p in enumerate(ids[:3])]
    ref, _ = _run(engine, False, jobs + [("x3", ids[3], greedy(12, ignore_eos=True))])

    aborted = []

    def meddle(eng, steps):
        if steps == 4:
            assert eng._inflight is not None  # the abort lands while a step is in flight
            aborted.append(eng.abort_request("ox1"))
            assert PENDING_TOKEN not in eng.scheduler.requests["ox0"].output_token_ids
        if steps == 6:
            eng.add_request("ox3", ids[3], greedy(12, ignore_eos=True))  # joins mid-way: a prefill step

    got, _ = _run(engine, True, [(f"o{r}", p, sp) for r, p, sp in jobs], on_step=meddle)
    assert got["ox0"] == ref["x0"] and got["ox2"] == ref["x2"] and got["ox3"] == ref["x3"]
    out = aborted[0]
    assert out is not None and out.finished and out.finish_reason == "abort"
    streamed = got["ox1"][0]  # nothing reaches the caller after its abort, and what did is right
    assert streamed == ref["x1"][0][: len(streamed)] and out.num_output_tokens == len(streamed) > 0


def test_mixed_sampling_falls_back_per_step_and_preemption_keeps_outputs(smollm2_dir):
    # a small cache (~180 tokens): 6 requests growing to ~40 tokens cannot all stay, so some are preempted
    small = make_engine(smollm2_dir, kv_memory="8MiB", max_model_len=128, block_size=16)
    ids = _ids(small, PROMPTS)
    jobs = [(f"p{i}", ids[i % len(ids)] + [i + 10], greedy(30, ignore_eos=True)) for i in range(6)]
    jobs.append(("seeded", ids[0], SamplingParams(max_tokens=12, temperature=0.8, seed=7)))
    jobs.append(("lp", ids[1], greedy(10, logprobs=2)))
    ref, _ = _run(small, False, jobs)
    preempted = small.scheduler.num_preemptions
    got, launched = _run(small, True, [(f"o{r}", p, sp) for r, p, sp in jobs])
    assert preempted > 0 and small.scheduler.num_preemptions > preempted
    assert launched["overlapped"] > 10
    assert {k[1:]: v for k, v in got.items()} == ref


def test_context_length_ends_overlapped_decodes(smollm2_dir):
    eng = make_engine(smollm2_dir, kv_memory="16MiB", max_model_len=48, block_size=16)
    ids = _ids(eng, PROMPTS[:2])
    jobs = [(f"m{i}", p, greedy(100, ignore_eos=True)) for i, p in enumerate(ids)]
    ref, _ = _run(eng, False, jobs)
    got, _ = _run(eng, True, [(f"o{r}", p, sp) for r, p, sp in jobs])
    assert {k[1:]: v for k, v in got.items()} == ref
    for i, p in enumerate(ids):
        assert got[f"om{i}"][1] == "length" and len(p) + len(got[f"om{i}"][0]) == 48
