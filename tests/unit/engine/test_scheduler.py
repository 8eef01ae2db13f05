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


def make_capped(budget=64, while_decoding=0, long_threshold=0, **kw):
    s = make(budget=budget, num_blocks=256, max_len=512, **kw)
    s.config.max_prefill_tokens_while_decoding = while_decoding
    s.config.long_prefill_token_threshold = long_threshold
    return s


def decoding(s: Scheduler, ids: list[str], count: int = 2) -> None:
    """Admit `ids` (short prompts) and run until each has sampled a token: they are decoding."""
    for i, rid in enumerate(ids):
        s.add_request(req(rid, 3, max_tokens=100, first=300 + 10 * i))
    for _ in range(count):
        run_step(s)
    assert all(s.requests[r].num_output_tokens >= 1 for r in ids)


def test_a_long_prompt_admitted_earlier_never_starves_decodes_admitted_after_it():
    # the prompt is in `running` before the decodes: its chunks still come after their tokens in every step
    s = make_capped(budget=16)
    s.add_request(req("long", 200, max_tokens=2))
    run_step(s)  # long takes the whole step: 16 of its 200 tokens
    for rid, tok in (("d1", 100), ("d2", 110)):
        blocks, _ = s.reserve_remote(req(rid, 4, max_tokens=50, first=tok))
        s.admit_remote(rid, SampledToken(5))  # a remote prefill's KV landed: it decodes from here
    for _ in range(5):
        out = run_step(s)
        got = {x.request_id: x.num_new_tokens for x in out.scheduled}
        assert got["d1"] == got["d2"] == 1 and got["long"] == 14
        assert out.num_scheduled_tokens <= 16


def test_prompt_tokens_beside_decodes_stay_under_their_cap_and_take_the_whole_budget_alone():
    s = make_capped(budget=64, while_decoding=8)
    s.add_request(req("alone", 100, max_tokens=2))
    out = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("alone", 64)]  # no decode: no cap
    decoding(s, ["a", "b"], count=1)  # admitted beside alone's last chunk: they sample their first tokens
    s.add_request(req("p1", 30, max_tokens=1, first=200))
    s.add_request(req("p2", 30, max_tokens=1, first=250))
    out = run_step(s)
    prompts = sum(x.num_new_tokens for x in out.scheduled if x.num_new_tokens > 1)
    assert {x.request_id for x in out.scheduled if x.num_new_tokens == 1} >= {"a", "b"}
    assert prompts <= 8
    # the cap is shared by every prompt in the step, the running one first
    steps = 0
    while not (s.requests.get("p1") is None and s.requests.get("p2") is None):
        out = run_step(s)
        steps += 1
        assert sum(x.num_new_tokens for x in out.scheduled if x.num_new_tokens > 1) <= 8
        assert {"a", "b"} <= {x.request_id for x in out.scheduled}
    assert steps >= 60 // 8 - 1


def test_long_prefill_token_threshold_caps_one_prompts_chunk():
    s = make_capped(budget=64, long_threshold=10)
    s.add_request(req("x", 25, max_tokens=1))
    s.add_request(req("y", 25, max_tokens=1, first=100))
    out = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("x", 10), ("y", 10)]
    out = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("x", 10), ("y", 10)]
    out = run_step(s)
    assert [(x.request_id, x.num_new_tokens, x.sample) for x in out.scheduled] == [("x", 5, True), ("y", 5, True)]


def test_a_landed_remote_prefill_decodes_at_once_even_when_prompts_fill_the_cap():
    s = make_capped(budget=32, while_decoding=8)
    s.add_request(req("long", 200, max_tokens=1))
    run_step(s)
    s.reserve_remote(req("r", 6, max_tokens=5, first=400))
    s.admit_remote("r", SampledToken(9))
    out = run_step(s)
    got = {x.request_id: x.num_new_tokens for x in out.scheduled}
    assert got == {"r": 1, "long": 8}  # the remote request makes this a decoding step: long is capped


def test_without_chunking_a_prompt_waits_for_a_step_whose_prompt_budget_holds_it():
    s = make_capped(budget=64, while_decoding=8, chunked=False)
    decoding(s, ["a"])
    s.add_request(req("p", 12, max_tokens=1, first=200))
    out = run_step(s)
    assert "p" not in {x.request_id for x in out.scheduled}  # 12 > 8 beside a decode
    s.add_request(req("q", 6, max_tokens=1, first=250))
    assert "q" not in {x.request_id for x in s.schedule().scheduled}  # FCFS: q waits behind p


def test_step_budget_settings_are_checked():
    import pytest

    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        SchedulerConfig(max_prefill_tokens_while_decoding=-1)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-3)


def test_a_reservation_leaves_a_block_for_each_decoding_stream_to_grow_into():
    s = make(num_blocks=10, budget=64, block_size=4, max_len=40)
    decoding(s, ["a", "b"], count=1)  # 3-token prompts + 1 token: one block each, 8 free
    assert s.pool.num_free_blocks == 8
    assert s.reserve_remote(req("big", 28, first=500)) is None  # 7 blocks would leave 1 for 2 streams
    blocks, _ = s.reserve_remote(req("fits", 24, first=600))  # 6 blocks leave 2
    assert len(blocks) == 6 and s.pool.num_free_blocks == 2
