"""The law's scale-up for a prefill queue and its scale-down steps, on hand-made metric streams (the toy profile of
test_autoscaler_law.py: a prefill replica computes ~9,900 prompt tokens/s): a queue counts only for what the ready
replicas leave of it after a cold start, and one scale-down releases at most half a pool.
"""

from __future__ import annotations

import math

import pytest
from unit.autoscaler.test_autoscaler_law import DECODE_TOK_S, PREFILL_TOK_S, config, obs, run, steady

KW = dict(d=2, out_tok_s=1.0 * DECODE_TOK_S)


def burst_with_queue(queue_tokens: int):
    """Ten calm windows on 2 prefill replicas, then 4 replicas' load with `queue_tokens` queued (a burst)."""
    calm = steady(0, 10, p=2, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW)
    burst = obs(150, p=2, prefill_tok_s=4.0 * PREFILL_TOK_S, queue_tokens=queue_tokens, queued=queue_tokens // 1000,
                ttft_p90=4.0, **KW)
    cfg = config(scale_up_cooldown_s=0.0, burst_memory_s=600.0)  # a 60-s cold start
    return run(calm + [burst], cfg)[-1]


def test_a_prefill_queue_counts_only_for_what_the_ready_replicas_leave_after_a_cold_start():
    """2 ready replicas compute 1.19 M prompt tokens in a 60-s cold start. A 1 M-token queue is a clump they drain
    before a new replica loads: the burst is sized and remembered on its load alone (4 replicas: 5 at 0.8). Of a
    3 M-token queue they leave 1.81 M, which adds 1.81 M / (9,900 tokens/s x 62 s) = 2.95 replicas."""
    cleared = burst_with_queue(1_000_000)
    assert cleared.prefill.action == "up" and "queue" in cleared.prefill.reason
    assert cleared.state.prefill.peak_need == pytest.approx(4.0, rel=1e-6)
    assert cleared.prefill.desired == 5
    rate = PREFILL_TOK_S
    left = 3_000_000 - 2 * rate * 60
    long = burst_with_queue(3_000_000)
    assert long.state.prefill.peak_need == pytest.approx(4.0 + left / (rate * 62), rel=1e-6)
    assert long.prefill.desired == math.ceil((4.0 + left / (rate * 62)) / 0.8)  # 9


def test_one_scale_down_releases_at_most_half_the_pool():
    """Ten prefill replicas carrying one replica's load: once a cooldown of history has passed, the pool steps
    10 -> 5 -> 3 -> 2 (each step half the pool at most, a cooldown apart), where the stabilisation window allowed
    ceil(1 / 0.8) = 2 at once."""
    cfg = config(scale_down_cooldown_s=120.0, burst_memory_s=0.0)
    quiet = steady(0, 40, p=10, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW)
    downs = [d for d in run(quiet, cfg) if d.prefill.action == "down"]
    assert [(d.prefill.current, d.prefill.desired) for d in downs] == [(10, 5), (5, 3), (3, 2)]
    assert "at most half the pool a step; the window allows 2" in downs[0].prefill.reason
    assert all(b.time - a.time >= 120 for a, b in zip(downs, downs[1:], strict=False))
