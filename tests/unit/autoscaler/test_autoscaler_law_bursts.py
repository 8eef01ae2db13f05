"""The law's answers to bursts, on hand-made metric streams (the toy profile of test_autoscaler_law.py: a prefill
replica computes ~9,900 prompt tokens/s): the burst memory that keeps capacity for bursts that recur, regret only
for a scale-down a cold start could not undo, a clump the ready prefill replicas clear, prefill's queue budget, and
bursts held (each role at a quantile of its need and its warm replicas) instead of chased.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from splitserve.autoscaler.law import LEVEL_QUANTILE, LEVEL_WINDOW_S, ControllerState, decide
from splitserve.autoscaler.observations import Observation, Percentiles
from unit.autoscaler.test_autoscaler_law import DECODE_TOK_S, PREFILL_TOK_S, config, obs, run, steady

KW = dict(d=2, out_tok_s=1.0 * DECODE_TOK_S)


def burst_then_quiet(t_burst: float, quiet_windows: int, need: float = 8.0):
    before = steady(0, 10, p=2, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW)
    burst = [obs(t_burst, p=2, prefill_tok_s=need * PREFILL_TOK_S, queue_tokens=300_000, queued=300, ttft_p90=4.0,
                 **KW)]
    after = steady(t_burst + 15, quiet_windows, p=2, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW)
    return before + burst + after


def test_burst_memory_keeps_the_peak_s_capacity_and_lets_it_go_by_half_lives():
    """A burst of 8 replicas' load (and a queue worth 0.5 more) on a pool sized for 1: with a 600 s memory the
    pool keeps capacity for that peak, halved every 600 s, at the 0.8 utilisation cap; without it the pool goes
    back to ceil(1 / 0.8) = 2 once the stabilisation window has passed."""
    stream = burst_then_quiet(150, 44)
    kept = run(stream, config(scale_down_cooldown_s=120.0, scale_up_cooldown_s=0.0, burst_memory_s=600.0))
    gone = run(stream, config(scale_down_cooldown_s=120.0, scale_up_cooldown_s=0.0, burst_memory_s=0.0))
    up = next(d for d in kept if d.time == 150)
    peak = up.state.prefill.peak_need
    assert up.prefill.action == "up" and 8.3 < peak < 8.7  # 8 + 300k tokens over a cold start (~0.49)
    assert gone[-1].prefill.desired == 2
    t_end = kept[-1].time
    assert t_end - 150 >= 600
    def at(age: float) -> int:  # replicas for the peak decayed over `age` s, at the 0.8 cap
        return math.ceil(peak * 0.5 ** (age / 600) / 0.8 - 1e-9)

    # scale-downs are a cooldown (120 s) apart, so the pool follows the decay at most that late
    assert at(t_end - 150) <= kept[-1].prefill.desired <= at(t_end - 150 - 120) < up.prefill.desired
    assert kept[-1].prefill.desired >= 4
    after = [d.prefill.desired for d in kept if d.time > 150]
    assert after == sorted(after, reverse=True)  # it only decays: no flapping on the way down


def test_a_burst_long_after_a_scale_down_is_no_regret():
    """Regret stretches the stabilisation window only for a burst within a cold start (+ the scale-up cooldown)
    of a scale-down; one later would have found the replicas idle all that time."""
    cfg = config(scale_down_cooldown_s=120.0, scale_up_cooldown_s=0.0, burst_memory_s=0.0)
    busy = steady(0, 10, p=8, prefill_tok_s=6.0 * PREFILL_TOK_S, **KW)
    quiet = steady(150, 12, p=8, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW)
    down = next(d for d in run(busy + quiet, cfg) if d.prefill.action == "down")
    for gap, stretched in ((30, True), (105, False)):  # 105 s: past 60 s load + 30 s cooldown, before the next down
        t = down.time + gap
        burst = [obs(t, p=down.prefill.desired, prefill_tok_s=6.0 * PREFILL_TOK_S, queue_tokens=300_000, queued=300,
                     ttft_p90=4.0, **KW)]
        between = [o for o in steady(down.time + 15, 20, p=8, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW) if o.time < t]
        decisions = run(busy + [o for o in quiet if o.time <= down.time] + between + burst, cfg)
        assert decisions[-1].prefill.action == "up"
        assert (decisions[-1].state.prefill.hold_s == 240.0) is stretched, (gap, decisions[-1].state.prefill.hold_s)


def test_burst_memory_follows_the_scale_down_cooldown_unless_set():
    """Unset, the memory's half-life is twice the scale-down cooldown (a cluster that wants capacity gone after
    10 s of calm does not keep a burst's for ten minutes)."""
    stream = burst_then_quiet(150, 20)
    short = run(stream, config(scale_down_cooldown_s=10.0, scale_up_cooldown_s=0.0))
    long = run(stream, config(scale_down_cooldown_s=10.0, scale_up_cooldown_s=0.0, burst_memory_s=600.0))
    assert short[-1].prefill.desired == 2  # ceil(1 / 0.8): the 20 s half-life has run out
    assert long[-1].prefill.desired >= 6


def test_a_clump_the_ready_prefill_replicas_clear_buys_nothing_but_an_itl_miss_buys_a_decode_replica():
    """A prefill queue over the burst threshold whose load and backlog fit the ready replicas at full utilisation
    is a clump already draining: prefill holds (a replica bought now would load after it is gone). An ITL miss
    on decode, whose load fits its replicas too, still buys one decode replica."""
    cfg = config(scale_up_cooldown_s=0.0)
    calm = steady(0, 7, p=4, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    clump = obs(105, p=4, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S,
                queue_tokens=60_000, queued=60, ttft_p90=1.5, itl_p90=0.25)
    last = run(calm + [clump], cfg)[-1]
    assert "queue" in last.prefill.reason and "clear" in last.prefill.reason and last.prefill.desired == 4, \
        last.prefill.reason
    assert last.decode.action == "up" and last.decode.desired == 3, last.decode.reason


def test_prefill_queue_budget_is_what_a_long_prompt_s_prefill_leaves_of_the_ttft_objective():
    """The toy profile prefills the mean 1000-token prompt in 0.101 s, so a prompt may queue 2 - 2.3 x 0.101 =
    1.77 s: a queue-wait p90 of 1.5 s is inside it (prefill's utilisation target keeps rising), one of 1.9 s is
    not (it falls 7%). Half the objective (1 s) would have counted both as misses."""
    cfg = config(max_utilization=0.95)

    def factor_after(wait_p90: float) -> float:
        state = ControllerState()
        for o in steady(0, 4, p=4, d=2, prefill_tok_s=2.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S):
            waits = Percentiles(wait_p90 / 2, wait_p90, wait_p90, 100)
            o = Observation(o.time, o.window_seconds, replace(o.prefill, queue_wait=waits), o.decode)
            state = decide(o, state, cfg).state
        return state.prefill.slo_factor

    assert factor_after(1.5) == pytest.approx(1.0)  # p99 1.5 s is not under half the budget: neither way
    assert factor_after(0.8) > 1.0  # the whole tail well inside: fuller
    assert factor_after(1.9) < 1.0


def test_prefill_scale_down_keeps_what_its_busiest_recent_window_needed():
    """A clump the ready prefill replicas absorb (no queue, no miss: no burst) in one window of a quiet pool: the
    plan smooths it over a minute (2.25 replicas: 3), but scale-down stays at what that window needed at full
    utilisation (6 replicas' load over 0.8 -> 8) while the window is within the stabilisation window."""
    cfg = config(scale_down_cooldown_s=120.0, burst_memory_s=0.0)
    quiet = dict(p=10, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW)
    stream = (steady(0, 6, **quiet) + [obs(90, p=10, prefill_tok_s=6.0 * PREFILL_TOK_S, **KW)]
              + steady(105, 30, **quiet))
    decisions = run(stream, cfg)
    assert not any(d.prefill.action == "up" for d in decisions)
    downs = [d for d in decisions if d.prefill.action == "down"]
    assert downs[0].time == 120 and downs[0].prefill.desired == 8  # the clump's window is within the last 120 s
    assert downs[1].time == 240 and downs[1].prefill.desired == 3  # the plan's 2.25 / 0.8, once it has left
    assert decisions[-1].prefill.desired == 2  # ceil(1 / 0.8)


def test_a_queue_on_smooth_load_is_answered_but_not_remembered():
    """On a smooth load whose spills decode takes, a queue is the load's own noise: the fast loop still answers
    it, but it leaves no burst memory (the spills and the SLO loop absorb such queues). The same queue after
    clumped load, or where the router does not spill, is remembered."""
    def queue_at(t: float) -> Observation:
        return obs(t, p=4, prefill_tok_s=3.0 * PREFILL_TOK_S, queue_tokens=300_000, queued=300, ttft_p90=4.0, **KW)

    smooth = steady(0, 40, p=4, prefill_tok_s=3.0 * PREFILL_TOK_S, **KW)
    clumps = [obs(15 * i, p=4, prefill_tok_s=(6.0 if i % 2 else 0.0) * PREFILL_TOK_S, **KW) for i in range(40)]
    spills = config(scale_down_cooldown_s=120.0, burst_memory_s=600.0, spills=True)
    none = replace(spills, spills=False)
    for name, stream, cfg, remembered in (("smooth", smooth, spills, False), ("clumps", clumps, spills, True),
                                          ("smooth, no spills", smooth, none, True)):
        answer = run(stream + [queue_at(600)], cfg, follow=False)[-1]
        assert answer.prefill.action == "up", (name, answer.prefill)
        assert (answer.state.prefill.peak_need > 0) == remembered, name


def test_a_busy_window_on_smooth_load_is_not_held_where_decode_takes_spills():
    """The busiest-window hold keeps what a busy window needed at full utilisation (3 replicas' load over 0.8
    -> 4) for the stabilisation window. On a smooth load whose spills decode takes, that window is noise the
    spills absorb: only the target is kept."""
    stream = steady(0, 40, p=10, prefill_tok_s=1.0 * PREFILL_TOK_S, **KW) + [
        obs(600, p=10, prefill_tok_s=3.0 * PREFILL_TOK_S, **KW)]
    held = {spills: run(stream, config(spills=spills), follow=False)[-1].state.prefill.recent[-1][1]
            for spills in (False, True)}
    assert held[False] == 4 and held[True] <= 2, held


def test_decode_learns_a_floor_from_a_burst_after_a_scale_down():
    """Decode scales down from 4 to 2 in a quiet spell; a burst of requests waiting for KV then shows that scale-down
    cut into standing capacity: decode keeps min(4, the burst's target: the 2 ready + 1) = 3 as a floor, halving
    every floor_memory_s, where without the floor it goes back to 2 once the burst's stabilisation window has
    passed."""
    busy = steady(0, 10, p=2, d=4, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=3.0 * DECODE_TOK_S)
    quiet = steady(150, 20, p=2, d=4, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)

    def stream(cfg):
        down = next(d for d in run(busy + quiet, cfg) if d.decode.action == "down")
        t = down.time + 120
        before = [o for o in busy + quiet if o.time <= down.time]
        calm = [o for o in steady(down.time + 15, 40, p=2, d=4, prefill_tok_s=1.0 * PREFILL_TOK_S,
                                  out_tok_s=1.0 * DECODE_TOK_S) if o.time < t]
        burst = [obs(t, p=2, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S, d_waiting=300,
                     d_running=20, kv=0.99)]
        after = steady(t + 15, 60, p=2, d=4, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
        return down, run(before + calm + burst + after, cfg)

    down, kept = stream(config(scale_down_cooldown_s=120.0, scale_up_cooldown_s=0.0, burst_memory_s=0.0,
                               floor_memory_s=3600.0))
    _, gone = stream(config(scale_down_cooldown_s=120.0, scale_up_cooldown_s=0.0, burst_memory_s=0.0,
                            floor_memory_s=0.0))
    assert down.decode.current == 4 and down.decode.desired == 2
    up = next(d for d in kept if d.time > down.time and d.decode.action == "up")
    assert up.state.decode.floor == 3.0 and up.decode.desired == 3
    assert kept[-1].time - up.time >= 900
    assert kept[-1].decode.desired == 3  # 900 s on, the floor has decayed to 3 * 0.5 ** (900 / 3600) = 2.5
    assert gone[-1].decode.desired == 2


def clumpy(n: int, base: float = 1.6, clump: float = 8.0, every: int = 4) -> list[Observation]:
    """A prompt load that is never smooth: `base` prefill replicas' load, and every `every`-th window a clump of
    `clump` replicas' that queues and misses the TTFT objective."""
    return [obs(15 * i, p=2, prefill_tok_s=clump * PREFILL_TOK_S, queue_tokens=300_000, queued=300, ttft_p90=4.0, **KW)
            if i % every == every - 1 else obs(15 * i, p=2, prefill_tok_s=base * PREFILL_TOK_S, **KW)
            for i in range(n)]


def test_held_bursts_keep_each_role_at_a_quantile_of_its_need_plus_its_warm_replicas():
    """bursts: hold on a load that is not smooth. Once the level window is full, prefill holds the 60% quantile
    of its need over it (the base load, 1.6 replicas: a quarter of the windows are clumps) at its utilisation
    plus 3 warm replicas, decode its own plus 1, and no clump starts a replica; the same law chasing the clumps
    (the same warm replicas) scales prefill up for the first one and keeps it."""
    stream = clumpy(90)
    held = run(stream, config(hold_bursts=True, warm_prefill=3, warm_decode=1))
    chased = run(stream, config(warm_prefill=3, warm_decode=1))
    full = [d for d in held if d.time >= LEVEL_WINDOW_S]
    assert len(full) >= 20
    for d in full:
        levels = [v for _, v in d.state.prefill.levels]
        assert d.time - d.state.prefill.levels[0][0] == pytest.approx(LEVEL_WINDOW_S - 15)
        level = sorted(levels)[int(LEVEL_QUANTILE * len(levels))]
        assert level == pytest.approx(1.6, rel=0.02)
        assert d.prefill.desired == math.ceil(level / d.prefill.utilization - 1e-9) + 3, d.prefill.reason
        assert d.decode.desired == math.ceil(1.0 / d.decode.utilization - 1e-9) + 1, d.decode.reason
        assert d.prefill.reason.startswith(f"level {d.prefill.desired}: need 1.6")
    assert max(d.prefill.desired for d in full) <= 6
    assert chased[3].prefill.action == "up" and chased[3].prefill.desired >= 12  # the first clump's window
    assert chased[-1].prefill.desired >= 12


def test_a_held_level_starts_at_the_largest_need_seen_and_settles_as_its_window_fills():
    """While the level window fills, the quantile runs from the largest need seen down to LEVEL_QUANTILE: after
    the first clump (at 45 s) prefill holds the clump's need, and it keeps holding it while clumps are more than
    the quantile's share of a window that is still short (a quarter of the windows are clumps: until the
    quantile falls under 75%, at 562 s), then falls to the base load's level, never to rise again."""
    held = run(clumpy(90), config(hold_bursts=True, warm_prefill=3, warm_decode=1))
    by_time = {d.time: d.prefill.desired for d in held}
    assert by_time[0] == by_time[30] <= 6  # no clump seen yet
    assert by_time[45] >= 12  # the first clump's need, held
    assert all(by_time[t] >= 12 for t in by_time if 45 <= t <= 540)
    settled = [by_time[t] for t in by_time if t >= 600]
    assert max(settled) <= 6 and len(set(settled)) == 1


def test_held_bursts_leave_a_smooth_load_to_the_law():
    """On a smooth load there is no burst to hold: the law with bursts held decides exactly as the law."""
    stream = steady(0, 30, p=2, prefill_tok_s=1.6 * PREFILL_TOK_S, **KW)
    stream.append(obs(450, p=2, prefill_tok_s=2.4 * PREFILL_TOK_S, queue_tokens=300_000, queued=300, ttft_p90=4.0,
                      **KW))
    held = run(stream, config(hold_bursts=True, warm_replicas=1))
    plain = run(stream, config(warm_replicas=1))
    assert [(d.prefill.desired, d.decode.desired, d.prefill.reason) for d in held[8:]] == \
        [(d.prefill.desired, d.decode.desired, d.prefill.reason) for d in plain[8:]]
    assert held[-1].prefill.action == "up"  # the queue on a smooth load is still answered


def test_a_role_s_own_warm_replicas_replace_the_shared_setting():
    stream = steady(0, 30, p=2, d=2, prefill_tok_s=1.6 * PREFILL_TOK_S, out_tok_s=1.6 * DECODE_TOK_S)
    last = run(stream, config(warm_replicas=2, warm_decode=0))[-1]
    assert last.replicas == {"prefill": 4, "decode": 2}
    last = run(stream, config(warm_prefill=1))[-1]
    assert last.replicas == {"prefill": 3, "decode": 2}
