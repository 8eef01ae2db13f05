"""The law's scale-down steps, on hand-made metric streams (the toy profile of test_autoscaler_law.py: a prefill
replica computes ~9,900 prompt tokens/s): where workers can flip, one scale-down releases at most half a pool.
"""

from __future__ import annotations

from unit.autoscaler.test_autoscaler_law import DECODE_TOK_S, PREFILL_TOK_S, config, run, steady

KW = dict(d=2, out_tok_s=1.0 * DECODE_TOK_S)


def test_one_scale_down_releases_at_most_half_the_pool():
    """Ten prefill replicas carrying one replica's load, workers that can flip: once a cooldown of history has
    passed, the pool steps 10 -> 5 -> 3 -> 2 (each step half the pool at most, a cooldown apart), where the
    stabilisation window allowed ceil(1 / 0.8) = 2 at once, as it still does without flips."""
    quiet = steady(0, 40, p=10, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW)
    downs = [d for d in run(quiet, config(scale_down_cooldown_s=120.0, burst_memory_s=0.0, flips=True))
             if d.prefill.action == "down"]
    assert [(d.prefill.current, d.prefill.desired) for d in downs] == [(10, 5), (5, 3), (3, 2)]
    assert "at most half the pool a step; the window allows 2" in downs[0].prefill.reason
    assert all(b.time - a.time >= 120 for a, b in zip(downs, downs[1:], strict=False))
    fixed = [d for d in run(quiet, config(scale_down_cooldown_s=120.0, burst_memory_s=0.0))
             if d.prefill.action == "down"]
    assert [(d.prefill.current, d.prefill.desired) for d in fixed] == [(10, 2)]
