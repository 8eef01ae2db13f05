"""The scheduler on its own, fed hand-made model outputs (no model, no torch)."""

from __future__ import annotations

from splitserve.common.sampling import SamplingParams
from splitserve.engine.config import CacheConfig, SchedulerConfig
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.scheduler import SampledToken, Scheduler


def make(num_blocks=64, budget=32, max_seqs=8, chunked=True, policy="fcfs", block_size=4, max_len=128):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     enable_chunked_prefill=chunked, policy=policy),
                     CacheConfig(block_size=block_size), num_blocks, max_len, salt="m")


def req(rid, n, max_tokens=4, priority=0, eos=(), first=1, **kw):
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw),
                   frozenset(eos), priority)


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = {x.request_id: SampledToken(token) for x in out.scheduled if x.sample}
    s.update_from_output(out, sampled)
    return out


def test_chunked_prefill_respects_budget_and_mixes_with_decode():
    s = make(budget=10)
    s.add_request(req("a", 3))
    out = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 3)]
    s.add_request(req("b", 25))
    out = run_step(s)
    # a decodes (1 token), b prefills a 9-token chunk in the same step
    assert [(x.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == [("a", 1, True), ("b", 9, False)]
    out = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    out = run_step(s)
    assert [(x.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == [("a", 1, True), ("b", 7, True)]
    assert s.requests["b"].num_output_tokens == 1


def test_no_chunking_waits_for_room():
    s = make(budget=10, chunked=False)
    s.add_request(req("a", 3))
    run_step(s)
    s.add_request(req("b", 9))
    out = run_step(s)  # a takes 1 token: 9 left, b fits exactly
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    s.add_request(req("c", 10, first=100))  # no prefix shared with b
    out = run_step(s)  # 2 decodes leave 8 < 10: c must wait whole
    assert "c" not in [x.request_id for x in out.scheduled]


def test_finish_by_length_and_eos_frees_blocks():
    s = make()
    s.add_request(req("a", 5, max_tokens=2))
    s.add_request(req("b", 5, max_tokens=10, eos=(9,)))
    run_step(s)
    run_step(s, token=9)
    assert s.requests.get("a") is None and s.requests.get("b") is None
    assert s.pool.num_used_blocks == 0


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=6, budget=64, block_size=4, max_len=24)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12))
    run_step(s)  # 2 blocks each (8 tokens) + both sampled 1 token
    for _ in range(6):
        run_step(s)
    assert s.num_preemptions >= 1
    b = s.requests["b"]
    assert b.num_preemptions >= 1 and b.num_output_tokens > 0  # generated tokens kept across preemption
    while s.has_unfinished:
        run_step(s)
    assert s.pool.num_used_blocks == 0


def test_abort_running_request_frees_its_blocks_at_once():
    s = make()
    s.add_request(req("a", 9, max_tokens=50))
    run_step(s)
    assert s.pool.num_used_blocks == 3
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.pool.num_used_blocks == 0 and not s.has_unfinished


def test_prefix_cache_hit_skips_computed_tokens():
    s = make()
    s.add_request(req("a", 10, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 10, max_tokens=1))
    out = s.schedule()
    (x,) = out.scheduled
    assert x.start == 8 and x.num_new_tokens == 2  # two full blocks of 4 reused
    assert s.requests["b"].num_cached_tokens == 8


def test_full_prompt_hit_still_computes_last_token():
    s = make()
    s.add_request(req("a", 8, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 8, max_tokens=1))
    (x,) = s.schedule().scheduled
    assert x.start == 4 and x.num_new_tokens == 4 and x.sample


def test_priority_policy_admits_lowest_first_and_preempts_highest():
    s = make(policy="priority", max_seqs=1)
    s.add_request(req("low", 3, priority=5))
    s.add_request(req("high", 3, priority=0))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["high"]


def test_remote_kv_reserve_then_admit_continues_from_first_token():
    s = make()
    r = req("r", 10, max_tokens=3)
    blocks, cached = s.reserve_remote(r)
    assert len(blocks) == 3 and cached == 0 and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert s.schedule().is_empty  # nothing to compute while the KV is in flight
    s.admit_remote("r", SampledToken(42))
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.start, x.num_new_tokens, x.sample) == (10, 1, True)
    assert r.output_token_ids == [42]


def test_remote_reserve_skips_locally_cached_prefix():
    s = make()
    s.add_request(req("a", 10, max_tokens=1))
    run_step(s)
    blocks, cached = s.reserve_remote(req("r", 10))
    assert cached == 8 and len(blocks) == 3


def test_held_blocks_stay_until_release():
    s = make()
    r = req("p", 9, max_tokens=1)
    r.hold_blocks = True
    s.add_request(r)
    run_step(s)
    assert r.is_finished and s.pool.num_used_blocks == 3
    assert s.release("p") and s.pool.num_used_blocks == 0
