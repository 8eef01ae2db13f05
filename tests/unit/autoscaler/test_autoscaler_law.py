"""The control law on hand-made metric streams (like the scheduler's tests): bursts, slow ramps, SLO misses on one
role only, the ratio bound and the GPU budget clamping a decision, cooldowns, hysteresis and no flapping.

The profile is a small made-up one with round numbers, so the expected replica counts can be worked out by
hand: a prefill replica computes 10,000 prompt tokens/s, a decode replica carries 1,000 output tokens/s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.autoscaler.bounds import Bounds, clamp
from splitserve.autoscaler.law import ControllerState, LawConfig, ScalingDecision, SmoothRegime, decide
from splitserve.autoscaler.observations import Observation, Percentiles, RoleObservation
from splitserve.autoscaler.planner import forecast, needs
from splitserve.autoscaler.profile import ReplicaProfile, StepCost, capacity_at_slo
from splitserve.common.config import ClusterSpec

# 1 ms per step + 0.1 ms per token: prefill of a 1000-token prompt = 101 ms, ~9,900 tokens/s flat out;
# decode: 100 sequences cost 11 ms per step -> ~9,000 tokens/s; max_num_seqs 10 caps it at 10 / 2 ms = 5,000
COST = StepCost(base_s=0.001, per_seq_s=0.0, per_token_s=0.0001, knee_tokens=0.0, per_ctx_token_s=0.0,
                per_attn_pair_s=0.0)
PROFILE = ReplicaProfile(name="toy", cost=COST, kv_capacity_tokens=10_000_000, kv_bytes_per_token=1,
                         max_num_seqs=10, max_num_batched_tokens=1000, kv_transfer_gbps=100.0,
                         kv_transfer_tail_s=0.0, cold_start_seconds={"native": 60.0})
PREFILL_TOK_S = 1000 / 0.101  # one full-budget step: 1000 tokens in 101 ms
DECODE_TOK_S = 10 / 0.002  # batch of 10 (max_num_seqs): 2 ms a step


def config(**kw) -> LawConfig:
    """The law with round numbers; the target utilisation stays at 0.8 unless a test lets slack raise it, and
    the router spills nothing to decode unless a test says so (prefill's sizing is then its own arithmetic).
    Without the smooth regime unless a test asks for it: the tests' steady loads are smooth, and each tests a
    mechanism's own arithmetic; the regime's tests ask for it (`SmoothRegime()`)."""
    base = dict(profile=PROFILE, bounds=Bounds(prefill_min=1, prefill_max=50, decode_min=1, decode_max=50),
                ttft_s=2.0, itl_s=0.1, scale_up_cooldown_s=30.0, scale_down_cooldown_s=120.0,
                planner_interval_s=60.0, cold_start_s=60.0, max_utilization=0.8, decode_compute_utilization=None,
                spills=False, smooth_regime=None)
    base.update(kw)
    return LawConfig(**base)


def obs(t: float, *, p: int = 2, d: int = 2, prefill_tok_s: float = 0.0, out_tok_s: float = 0.0,
        p_starting: int = 0, d_starting: int = 0, queue_tokens: int = 0, queued: int = 0, d_waiting: int = 0,
        d_running: int = 0, kv: float = 0.1, ttft_p90: float | None = 0.2, itl_p90: float | None = 0.01) -> Observation:
    """One window of made-up metrics: 1000-token prompts, 100-token outputs."""
    rate = prefill_tok_s / 1000
    ttft = Percentiles(ttft_p90 / 2, ttft_p90, ttft_p90, 100) if ttft_p90 is not None else Percentiles()
    itl = Percentiles(itl_p90 / 2, itl_p90, itl_p90, 1000) if itl_p90 is not None else Percentiles()
    pre = RoleObservation("prefill", p, p_starting, arrival_rate=rate, input_tokens_per_s=prefill_tok_s,
                          mean_input_tokens=1000, mean_output_tokens=100, num_waiting=queued,
                          waiting_prefill_tokens=queue_tokens, num_running=min(queued, p), ttft=ttft)
    dec = RoleObservation("decode", d, d_starting, arrival_rate=out_tok_s / 100, output_tokens_per_s=out_tok_s,
                          mean_input_tokens=1000, mean_output_tokens=100, num_waiting=d_waiting,
                          num_running=d_running, kv_usage=kv, ttft=ttft, itl=itl)
    return Observation(t, 15.0, pre, dec)


def run(stream: list[Observation], cfg: LawConfig, follow: bool = True) -> list[ScalingDecision]:
    """Feed observations in order; with `follow`, each later one reports the replicas the last decision set
    (as ready: the stream's own starting counts are kept)."""
    state, out = ControllerState(), []
    for o in stream:
        if follow and out:
            last = out[-1]
            o = Observation(o.time, o.window_seconds,
                            _with(o.prefill, last.prefill.desired - o.prefill.replicas_starting),
                            _with(o.decode, last.decode.desired - o.decode.replicas_starting))
        decision = decide(o, state, cfg)
        state = decision.state
        out.append(decision)
    return out


def _with(ro: RoleObservation, ready: int) -> RoleObservation:
    from dataclasses import replace

    return replace(ro, replicas_ready=max(0, ready))


def steady(t0: float, n: int, **kw) -> list[Observation]:
    return [obs(t0 + 15 * i, **kw) for i in range(n)]


# -- the profile's arithmetic ----------------------------------------------------------------------------
def test_capacity_at_slo_matches_hand_arithmetic():
    cap = capacity_at_slo(PROFILE, 2.0, 0.1, 1000, 100, max_utilization=1.0)
    assert cap.prefill_raw_tokens_per_s == pytest.approx(PREFILL_TOK_S)
    assert cap.decode_batch == 10 and cap.decode_tokens_per_s == pytest.approx(DECODE_TOK_S)
    assert 0.85 < cap.prefill_utilization < 0.95  # 101 ms of service leaves most of 2 s for queueing
    # a prompt whose prefill alone takes most of the objective leaves little room for queueing
    slow = capacity_at_slo(PROFILE, 2.0, 0.1, 15_000, 100, max_utilization=1.0)
    assert slow.prefill_utilization < 0.3


def test_needs_divide_load_by_capacity():
    n = needs(obs(0, prefill_tok_s=3 * PREFILL_TOK_S, out_tok_s=2 * DECODE_TOK_S), PROFILE, 2.0, 0.1)
    assert n.prefill == pytest.approx(3.0)
    assert n.decode == pytest.approx(2.0)


def test_forecast_extrapolates_a_lasting_rise_but_not_a_short_ramp():
    rising = tuple((15.0 * i, 1.0 + 0.01 * 15 * i) for i in range(20))  # +0.01 replicas per s
    assert forecast(rising, 285.0, 100.0, 150.0) == pytest.approx(1 + 0.01 * 385, rel=1e-6)
    assert forecast(rising, 285.0, 100.0, 150.0, max_growth=0.1) == pytest.approx((1 + 0.01 * 285) * 1.1)
    ramp = tuple((15.0 * i, 1.0 + 3 * i) for i in range(8))  # two minutes of a steep ramp
    assert forecast(ramp, 105.0, 100.0, 150.0) == 22.0  # too little history for a trend: the latest value


# -- steady load, hysteresis, no flapping ----------------------------------------------------------------
def test_steady_load_sizes_each_pool_and_then_holds():
    cfg = config()
    # 4.0 prefill replicas' work and 3.2 decode replicas' work at target 0.8 -> 5 and 4
    stream = steady(0, 40, p=5, d=4, prefill_tok_s=4.0 * PREFILL_TOK_S, out_tok_s=3.2 * DECODE_TOK_S)
    decisions = run(stream, cfg)
    assert all(d.replicas == {"prefill": 5, "decode": 4} for d in decisions)
    assert all(d.prefill.action == "hold" and d.decode.action == "hold" for d in decisions)


def test_noise_inside_the_band_does_not_flap():
    cfg = config()
    stream = []
    for i in range(80):  # need wanders between 3.2 and 4.4 prefill replicas: inside [0.6, 0.9] of 5
        wobble = 3.2 + 1.2 * ((i * 7) % 5) / 4
        stream.append(obs(15 * i, p=5, d=4, prefill_tok_s=wobble * PREFILL_TOK_S, out_tok_s=3.0 * DECODE_TOK_S))
    decisions = run(stream, cfg)
    changes = [d for d in decisions if d.changed]
    assert changes == [], [d.reason for d in changes]


def test_load_alternating_around_a_threshold_changes_replicas_rarely():
    cfg = config()
    stream = []
    for i in range(120):  # every other window the load doubles: the 60 s mean still moves little
        load = 6.0 if i % 2 else 3.0
        stream.append(obs(15 * i, p=6, d=4, prefill_tok_s=load * PREFILL_TOK_S, out_tok_s=3.0 * DECODE_TOK_S))
    decisions = run(stream, cfg)
    prefill = [d.prefill.desired for d in decisions]
    flips = sum(1 for a, b in zip(prefill, prefill[1:], strict=False) if a != b)
    assert flips <= 2, prefill


# -- scale-up: slow ramp, burst, one role only -----------------------------------------------------------
def test_slow_ramp_scales_up_ahead_of_need():
    cfg = config()
    stream = []
    for i in range(60):  # prefill need grows 1 replica every 150 s: from 2 to 8 over 15 minutes
        need = 2.0 + i * 15 / 150
        stream.append(obs(15 * i, p=3, d=2, prefill_tok_s=need * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S))
    decisions = run(stream, cfg)
    for i, d in enumerate(decisions):
        need_on_arrival = 2.0 + (15 * i + cfg.cold_start_s) / 150  # when replicas asked for now are ready
        if i >= 16:  # once the trend line has history, capacity asked for covers the need a load time ahead
            assert d.prefill.desired >= need_on_arrival, (i, d.prefill)
    assert decisions[-1].prefill.desired <= 13  # and it does not run away (8.0 + lead at 0.8 -> about 11)
    assert all(d.decode.desired == 2 for d in decisions)  # decode's load never moved


def test_burst_on_prefill_scales_prefill_only_and_sizes_for_the_backlog():
    cfg = config()
    calm = steady(0, 10, p=2, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    # a burst: 4x the prompts, 300k tokens queued (30 s of one replica), TTFT p90 over the objective
    burst = obs(150, p=2, d=2, prefill_tok_s=4.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S,
                queue_tokens=300_000, queued=300, ttft_p90=5.0)
    decisions = run(calm + [burst], cfg)
    last = decisions[-1]
    assert last.prefill.action == "up" and "queue" in last.prefill.reason
    assert last.prefill.desired >= 3
    assert last.decode.action == "hold"


def test_itl_miss_on_decode_scales_decode_only():
    cfg = config()
    stream = steady(0, 8, p=2, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    stream.append(obs(120, p=2, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S, itl_p90=0.25))
    last = run(stream, cfg)[-1]
    assert last.decode.action == "up" and "ITL" in last.decode.reason
    assert last.prefill.action == "hold"


def test_ttft_miss_caused_by_decode_admission_scales_decode_not_prefill():
    """TTFT misses while prefill has no queue and decode is full (seats and KV) with 40 requests held back:
    decode scales up, prefill holds. The load before was smooth, where one window is noise (the smooth regime's
    shorter trend): decode goes up at the second such window; without the regime, at the first."""
    cfg = config(smooth_regime=SmoothRegime())
    stream = steady(0, 8, p=2, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    stream += [obs(t, p=2, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S, ttft_p90=6.0,
                   d_waiting=40, d_running=20, kv=0.95) for t in (120, 135)]
    first, second = run(stream, cfg)[-2:]
    assert (first.decode.action, second.decode.action) == ("hold", "up"), (first.decode, second.decode)
    assert first.prefill.action == second.prefill.action == "hold", (first.prefill.reason, second.prefill.reason)
    at_once = run(stream[:-1], replace(cfg, smooth_regime=None))[-1]
    assert at_once.decode.action == "up" and at_once.prefill.action == "hold", at_once


def test_starting_replicas_are_counted_so_a_burst_is_not_answered_twice():
    cfg = config(scale_up_cooldown_s=0.0)
    calm = steady(0, 8, p=2, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    burst = [obs(120 + 15 * i, p=2, d=2, p_starting=5 if i else 0, prefill_tok_s=4.0 * PREFILL_TOK_S,
                 out_tok_s=1.0 * DECODE_TOK_S, queue_tokens=300_000, queued=300, ttft_p90=5.0) for i in range(3)]
    decisions = run(calm + burst, cfg, follow=False)
    first, second, third = decisions[-3:]
    # 4.0 + the backlog (300k over 62 s of 9.9k/s ~ 0.5), at full utilisation (0.8 here) -> 6
    assert first.prefill.desired == 6
    assert second.prefill.desired == 7 and third.prefill.desired == 7  # 2 ready + 5 starting: nothing more


# -- cooldowns ---------------------------------------------------------------------------------------------
def test_scale_up_cooldown_spaces_scale_ups():
    cfg = config(scale_up_cooldown_s=60.0)
    stream = steady(0, 8, p=2, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    stream += [obs(120 + 15 * i, p=2, d=2, prefill_tok_s=(3.0 + 3 * i) * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S,
                   queue_tokens=200_000, queued=200, ttft_p90=4.0) for i in range(6)]
    decisions = run(stream, cfg)
    ups = [d.time for d in decisions if d.prefill.action == "up"]
    assert len(ups) >= 2
    assert all(b - a >= 60.0 for a, b in zip(ups, ups[1:], strict=False))
    held = [d for d in decisions if "cooldown" in d.prefill.reason]
    assert held, "a scale-up inside the cooldown is held and says why"


def test_scale_down_waits_for_the_cooldown_and_the_whole_stabilisation_window():
    cfg = config(scale_down_cooldown_s=120.0)
    busy = steady(0, 10, p=10, d=2, prefill_tok_s=7.5 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    quiet = steady(150, 30, p=10, d=2, prefill_tok_s=2.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    decisions = run(busy + quiet, cfg)
    downs = [d for d in decisions if d.prefill.action == "down"]
    assert downs, "the load fell to a fifth: prefill must scale down"
    assert downs[0].time >= 150 + 120 - 15  # not before the busy targets left the 120 s window
    assert all(b.time - a.time >= 120 for a, b in zip(downs, downs[1:], strict=False))  # a cooldown apart
    assert decisions[-1].prefill.desired == 3  # ceil(2.0 / 0.8), reached in at most two steps
    assert len(downs) <= 2
    assert all(d.decode.action == "hold" for d in decisions)


def test_a_smooth_load_lets_prefill_scale_down_sooner_than_a_bursty_one():
    """Prompt load that varies little over the last 10 minutes is smooth: prefill's cooldown and base window
    drop to `smooth_prefill_hold_s` (180 s here, against a 300 s cooldown), or three cold starts if longer. The
    same mean in clumps (every other window empty) waits the whole cooldown."""
    cfg = config(scale_down_cooldown_s=300.0, smooth_prefill_hold_s=180.0)
    kw = dict(p=10, d=2, out_tok_s=1.0 * DECODE_TOK_S)
    smooth = [obs(15 * i, prefill_tok_s=2.0 * PREFILL_TOK_S, **kw) for i in range(40)]
    clumps = [obs(15 * i, prefill_tok_s=(4.0 if i % 2 else 0.0) * PREFILL_TOK_S, **kw) for i in range(40)]
    first_down = {}
    for name, stream in (("smooth", smooth), ("clumps", clumps)):
        downs = [d for d in run(stream, cfg) if d.prefill.action == "down"]
        assert downs, name
        first_down[name] = downs[0].time
    assert 180 <= first_down["smooth"] < 300 <= first_down["clumps"], first_down
    # and at least three cold starts: with 90 s ones, 270 s
    slow = config(scale_down_cooldown_s=300.0, smooth_prefill_hold_s=180.0, cold_start_s=90.0)
    downs = [d for d in run(smooth, slow) if d.prefill.action == "down"]
    assert downs and 270 <= downs[0].time < 300, [d.time for d in downs]


def test_a_smooth_load_lets_decode_go_after_two_thirds_of_the_cooldown():
    """The smooth regime: on a smooth load whose need halved, decode's first scale-down comes after 2/3 of the
    scale-down cooldown (200 s of 300), and after all of it without the regime or when the load is clumps. The
    operator's settings move by its factors; its bounds leave a config already past them as it is."""
    cfg = config(scale_down_cooldown_s=300.0, smooth_regime=SmoothRegime())
    kw = dict(p=2, prefill_tok_s=1.0 * PREFILL_TOK_S)
    smooth = [obs(15 * i, d=6, out_tok_s=2.0 * DECODE_TOK_S, **kw) for i in range(40)]
    clumps = [obs(15 * i, d=6, out_tok_s=(4.0 if i % 2 else 0.0) * DECODE_TOK_S, p=2,
                  prefill_tok_s=(2.0 if i % 2 else 0.0) * PREFILL_TOK_S) for i in range(40)]

    def first_down(stream: list[Observation], c: LawConfig) -> float:
        downs = [d.time for d in run(stream, c) if d.decode.action == "down"]
        assert downs
        return downs[0]

    assert 200 <= first_down(smooth, cfg) < 300 <= first_down(smooth, replace(cfg, smooth_regime=None))
    assert first_down(clumps, cfg) >= 300
    regime = SmoothRegime()
    stricter = regime.apply(replace(cfg, max_utilization=0.8, smoothing_s=15.0, burst_queue_fraction=0.9))
    assert (stricter.max_utilization, stricter.smoothing_s, stricter.burst_queue_fraction) == (0.8, 15.0, 0.9)
    loose = regime.apply(replace(cfg, max_utilization=0.95, smoothing_s=60.0, burst_queue_fraction=0.5))
    assert (loose.max_utilization, loose.smoothing_s, loose.burst_queue_fraction) == (0.9, 30.0, 0.75)
    assert loose.scale_down_cooldown_s == pytest.approx(200.0) and loose.scale_up_cooldown_s == 60.0
    assert loose.target_utilization == pytest.approx(0.752) and loose.low_utilization > 0


def test_a_smooth_load_counts_decodes_spare_compute_as_prefill_capacity():
    """While the load is smooth and the router spills, the prompts a short prefill pool would queue go to decode
    workers, so prefill's plan counts decode's spare compute (its ready replicas at its target, less its own
    planned need), down to half of the plan. Not on clumped load, not when the router does not spill, and not
    when KV bounds decode's batch (no room for spilled prompts beside its long contexts)."""
    def last(stream: list[Observation], **kw) -> ScalingDecision:
        return run(stream, config(**kw), follow=False)[-1]

    def smooth(d: int) -> list[Observation]:
        return steady(0, 40, p=6, d=d, prefill_tok_s=4.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)

    alone = last(smooth(4))
    assert alone.prefill.planned == pytest.approx(4.0)
    shared = last(smooth(3), spills=True)
    spare = 3 * shared.decode.utilization - shared.decode.planned
    assert 1.0 < spare < 2.0  # decode: 3 replicas at 0.8 for one replica's load
    assert shared.prefill.planned == pytest.approx(alone.prefill.planned - spare)
    # a decode pool with room for a whole prefill pool's prompts carries at most half of prefill's plan
    assert last(smooth(12), spills=True).prefill.planned == pytest.approx(alone.prefill.planned / 2)
    clumps = [obs(15 * i, p=6, d=4, prefill_tok_s=(8.0 if i % 2 else 0.0) * PREFILL_TOK_S,
                  out_tok_s=1.0 * DECODE_TOK_S) for i in range(40)]
    assert last(clumps, spills=True).prefill.planned == last(clumps).prefill.planned
    kv_bound = replace(PROFILE, kv_capacity_tokens=5_000)  # not 10 sequences of 1,100 tokens
    assert kv_bound.max_num_seqs == 10
    assert (last(smooth(4), spills=True, profile=kv_bound).prefill.planned
            == last(smooth(4), profile=kv_bound).prefill.planned)


def test_a_smooth_load_sizes_decode_at_every_prompt_it_serves():
    """Decode's batch is sized at the context of the prompts prefill receives (the long ones) unless the load is
    smooth; then at the mean prompt decode serves, short local ones included: a larger batch, a smaller need."""
    from dataclasses import replace

    cost = replace(COST, per_ctx_token_s=2e-5)  # attention over the context: longer prompts, smaller batches
    profile = replace(PROFILE, cost=cost)
    cfg = config(profile=profile)

    def mixed(t: float, load: float) -> Observation:  # prefill gets 1000-token prompts, decode also 100-token ones
        o = obs(t, prefill_tok_s=load * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
        return replace(o, decode=replace(o.decode, mean_input_tokens=300))

    last = mixed(15 * 30, 2.0)
    smooth = run([mixed(15 * i, 2.0) for i in range(30)] + [last], cfg)[-1]
    clumps = run([mixed(15 * i, 4.0 if i % 2 else 0.0) for i in range(30)] + [last], cfg)[-1]
    n_long = needs(last, profile, cfg.ttft_s, cfg.itl_s)
    n_all = needs(last, profile, cfg.ttft_s, cfg.itl_s, decode_at_every_prompt=True)
    assert n_all.decode < 0.8 * n_long.decode
    assert smooth.decode.need == pytest.approx(n_all.decode)
    assert clumps.decode.need == pytest.approx(n_long.decode)
    assert n_all.prefill == n_long.prefill


def test_a_burst_right_after_a_scale_down_stretches_the_hold():
    cfg = config(scale_down_cooldown_s=120.0, scale_up_cooldown_s=0.0, burst_memory_s=0.0)  # the window alone
    kw = dict(d=2, out_tok_s=1.0 * DECODE_TOK_S)
    busy = steady(0, 10, p=8, prefill_tok_s=6.0 * PREFILL_TOK_S, **kw)
    quiet = steady(150, 12, p=8, prefill_tok_s=1.0 * PREFILL_TOK_S, **kw)
    decisions = run(busy + quiet, cfg)
    down = next(d for d in decisions if d.prefill.action == "down")
    t = down.time + 30  # a burst soon after: the scale-down was a mistake a cold start cannot undo in time
    burst = [obs(t, p=down.prefill.desired, prefill_tok_s=6.0 * PREFILL_TOK_S, queue_tokens=300_000, queued=300,
                 ttft_p90=4.0, **kw)]
    after = steady(t + 15, 40, p=8, prefill_tok_s=1.0 * PREFILL_TOK_S, **kw)
    decisions = run(busy + [o for o in quiet if o.time <= down.time] + burst + after, cfg)
    up = next(d for d in decisions if d.time == t)
    assert up.prefill.action == "up" and up.state.prefill.hold_s == 240.0  # doubled
    later_down = next(d for d in decisions if d.time > t and d.prefill.action == "down")
    assert later_down.time - t >= 240 - 15  # the burst's target stays for the longer window
    assert decisions[-1].state.prefill.hold_s == 120.0  # a quiet window later it is back to the cooldown
    assert decisions[-1].prefill.desired == 2


def test_no_scale_down_before_a_cooldown_of_history():
    cfg = config(scale_down_cooldown_s=300.0)
    decisions = run(steady(0, 10, p=10, d=10, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S), cfg)
    assert all(d.prefill.action == "hold" and d.decode.action == "hold" for d in decisions)


def test_no_scale_down_while_queueing():
    cfg = config(scale_down_cooldown_s=0.0)
    stream = steady(0, 20, p=10, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S,
                    queued=30, queue_tokens=30_000, ttft_p90=3.0)
    decisions = run(stream, cfg)
    assert all(d.prefill.action != "down" for d in decisions)


# -- cold start lead, warm minimum -------------------------------------------------------------------------
def test_longer_model_load_leads_further():
    stream = []
    for i in range(30):
        need = 2.0 + i * 15 / 100  # +1 replica per 100 s
        stream.append(obs(15 * i, p=3, d=2, prefill_tok_s=need * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S))
    short = run(stream, config(cold_start_s=10.0, max_forecast_growth=10.0))[-1].prefill
    long = run(stream, config(cold_start_s=300.0, max_forecast_growth=10.0))[-1].prefill
    assert long.planned - short.planned == pytest.approx(2.9, abs=0.05)  # 290 s more lead at +0.01 replicas/s
    assert long.desired > short.desired


def test_slack_under_the_objectives_lets_a_role_run_fuller():
    # decode steps take a tenth of the ITL objective and nothing waits; 5.45 replicas of work on 6 is 91%
    stream = steady(0, 40, p=5, d=6, prefill_tok_s=3.0 * PREFILL_TOK_S, out_tok_s=5.45 * DECODE_TOK_S, itl_p90=0.01)
    fixed = run(stream, config(max_utilization=0.8))
    slack = run(stream, config(max_utilization=0.95))
    assert fixed[-1].decode.desired == 7  # over the band at a fixed 0.8 target: ceil(5.45 / 0.8)
    assert slack[-1].decode.utilization == pytest.approx(0.95)  # +2% a window while p90 < half the objective
    assert all(d.decode.desired == 6 for d in slack)  # the raised target keeps 91% inside the band


def test_where_decode_takes_spills_on_a_smooth_load_a_tail_inside_the_objective_is_slack():
    """The SLO loop raises a role's target on windows whose p99 is under half the objective. Where decode takes
    the router's spills on a smooth load, the tail is the spills' noise (a step carrying a spilled prompt's
    chunk), so a p90 under half and a p99 within the objective is slack there; not without spills, not on
    clumped load, not for a decode pool of two, and not for a p99 over the objective."""
    def tail(o: Observation, p99: float) -> Observation:
        lat = Percentiles(0.01, 0.02, p99, 1000)
        ttft = Percentiles(0.2, 0.4, 20 * p99, 100)  # TTFT's tail against its 2 s objective, the same ratio
        return replace(o, prefill=replace(o.prefill, ttft=ttft), decode=replace(o.decode, itl=lat, ttft=ttft))

    def final(p99: float = 0.07, d: int = 6, clumped: bool = False, **kw) -> ScalingDecision:
        stream = [tail(obs(15 * i, p=5, d=d, prefill_tok_s=(6.0 if i % 2 else 0.0 if clumped else 3.0)
                           * PREFILL_TOK_S, out_tok_s=2.0 * DECODE_TOK_S), p99) for i in range(40)]
        return run(stream, config(max_utilization=0.95, **kw), follow=False)[-1]

    shared = final(spills=True)
    assert shared.decode.utilization == pytest.approx(0.95) and shared.prefill.utilization > 0.9
    for held in (final(), final(clumped=True, spills=True), final(p99=0.12, spills=True)):
        assert held.decode.utilization == pytest.approx(0.8) and held.prefill.utilization <= 0.8
    assert final(d=2, spills=True).decode.utilization == pytest.approx(0.8)  # one replica is half the pool
    assert final(d=2, spills=True).prefill.utilization > 0.9  # prefill's tail is the spills' all the same


def test_a_decode_pool_kv_bounds_plans_for_its_recent_peak_and_a_fifth_more():
    """Where KV bounds decode's batch, surges of long contexts fill the cache faster than a cold start, so
    decode plans for the largest need of the trend window (5 minutes) and a fifth more; a pool compute bounds
    plans from its smoothed need, and the peak leaves the plan once it is older than the window."""
    kv_bound = replace(PROFILE, kv_capacity_tokens=5_000)  # not 10 sequences of 1,100 tokens

    def decisions(profile: ReplicaProfile) -> list[ScalingDecision]:
        stream = [obs(15 * i, p=4, d=8, prefill_tok_s=2.0 * PREFILL_TOK_S,
                      out_tok_s=(6.0 if i == 20 else 1.0) * DECODE_TOK_S) for i in range(60)]
        return run(stream, config(profile=profile), follow=False)

    bound, free = decisions(kv_bound), decisions(PROFILE)
    peak = bound[20].decode.need
    assert peak > 4 * bound[19].decode.need
    for d in bound[21:39]:  # the peak is in the window: planned at 1.2x it
        assert d.decode.planned == pytest.approx(1.2 * peak), d.time
    assert bound[-1].decode.planned < 0.5 * peak  # 10 minutes on: back to the load's own need
    assert max(d.decode.planned for d in free[24:39]) < 0.6 * 1.2 * free[20].decode.need


def test_a_decode_pool_kv_does_not_bound_may_run_above_its_flat_out_need():
    # 6.2 replicas of decode work (priced in decode-only steps) on 8: slack raises decode's target up to 1.1
    # while 10 sequences of the mean context fit the cache, and 6.2 < 0.825 x 8 lets it give one back
    stream = steady(0, 60, p=5, d=8, prefill_tok_s=3.0 * PREFILL_TOK_S, out_tok_s=6.2 * DECODE_TOK_S, itl_p90=0.01)
    roomy = run(stream, config(max_utilization=0.95, decode_compute_utilization=1.1))
    assert roomy[-1].decode.utilization == pytest.approx(1.1) and roomy[-1].prefill.utilization <= 0.95
    assert roomy[-1].decode.desired == 7  # 6.2 on 7 is 0.89, inside the band (0.825..1.24)
    off = run(stream, config(max_utilization=0.95))
    assert off[-1].decode.utilization == pytest.approx(0.95) and off[-1].decode.desired == 8  # 6.2 > 0.71 x 8
    small_kv = replace(PROFILE, kv_capacity_tokens=10_000)  # 9,000 usable / 1,050 tokens a sequence: 8 < 10
    tight = run(stream, config(profile=small_kv, max_utilization=0.95, decode_compute_utilization=1.1))
    assert tight[-1].decode.utilization == pytest.approx(0.95)


def test_warm_replicas_stay_above_the_need():
    stream = steady(0, 30, p=2, d=2, prefill_tok_s=1.6 * PREFILL_TOK_S, out_tok_s=1.6 * DECODE_TOK_S)
    plain = run(stream, config())[-1]
    warm = run(stream, config(warm_replicas=2))[-1]
    assert plain.replicas == {"prefill": 2, "decode": 2}
    assert warm.replicas == {"prefill": 4, "decode": 4}


# -- bounds: min/max, ratio, GPU budget ----------------------------------------------------------------------
def test_ratio_max_raises_decode_instead_of_starving_prefill():
    cfg = config(bounds=Bounds(prefill_min=1, prefill_max=50, decode_min=1, decode_max=50, ratio_max=1.0))
    stream = steady(0, 10, p=2, d=2, prefill_tok_s=1.6 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    stream.append(obs(150, p=2, d=2, prefill_tok_s=4.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S,
                      queue_tokens=400_000, queued=400, ttft_p90=5.0))
    last = run(stream, cfg)[-1]
    assert last.prefill.desired >= 5
    assert last.decode.desired == last.prefill.desired  # P/D <= 1: decode raised to match
    assert any("ratio.max" in c for c in last.clamps) and "clamped by ratio.max" in last.reason


def test_ratio_min_raises_prefill():
    cfg = config(bounds=Bounds(prefill_min=0, prefill_max=50, decode_min=1, decode_max=50, ratio_min=0.5))
    last = run(steady(0, 5, p=1, d=8, prefill_tok_s=0.1 * PREFILL_TOK_S, out_tok_s=6.0 * DECODE_TOK_S), cfg)[-1]
    assert last.decode.desired == 8 and last.prefill.desired == 4


def test_gpu_budget_caps_and_shares_the_shortfall():
    cfg = config(bounds=Bounds(prefill_min=1, prefill_max=50, decode_min=1, decode_max=50, gpu_budget=12,
                               gpus_per_replica=2))
    stream = steady(0, 10, p=2, d=2, prefill_tok_s=8.0 * PREFILL_TOK_S, out_tok_s=8.0 * DECODE_TOK_S)
    last = run(stream, cfg)[-1]
    p, d = last.prefill.desired, last.decode.desired
    assert (p + d) * 2 <= 12
    assert (p, d) == (3, 3)  # both wanted 10: the six replicas the budget allows are shared evenly
    assert any("gpuBudget" in c for c in last.clamps)


def test_gpu_budget_covers_each_roles_load_before_headroom():
    cfg = config(bounds=Bounds(prefill_min=1, prefill_max=50, decode_min=1, decode_max=50, gpu_budget=10))
    # prefill misses TTFT for a while (its target utilisation falls, it wants many replicas); decode's load
    # needs 3 replicas flat out: the budget keeps those 3 for decode
    stream = steady(0, 12, p=2, d=2, prefill_tok_s=3.0 * PREFILL_TOK_S, out_tok_s=2.5 * DECODE_TOK_S,
                    queue_tokens=100_000, queued=100, ttft_p90=3.0)
    last = run(stream, cfg)[-1]
    assert last.decode.desired >= 3 and last.prefill.desired + last.decode.desired == 10


def test_min_and_max_replicas():
    assert clamp(0, 100, Bounds(prefill_min=1, prefill_max=4, decode_min=2, decode_max=6)) == \
        (1, 6, ["prefill.minReplicas 1", "decode.maxReplicas 6"])


def test_infeasible_bounds_are_reported():
    p, d, notes = clamp(5, 5, Bounds(prefill_min=3, prefill_max=4, decode_min=3, decode_max=4, gpu_budget=4))
    assert notes == ["bounds_infeasible"] and (p, d) == (3, 3)


def test_colocated_mode_has_no_prefill_pool():
    cfg = config(bounds=Bounds(decode_min=1, decode_max=20, disaggregated=False))
    last = run(steady(0, 5, p=0, d=2, out_tok_s=4.0 * DECODE_TOK_S), cfg)[-1]
    assert last.prefill.desired == 0 and last.decode.desired == 5


# -- the decision as the actuators read it ----------------------------------------------------------------
def test_decision_is_deterministic_and_serialises_for_status_and_metrics():
    import json

    cfg = config()
    stream = steady(0, 12, p=2, d=2, prefill_tok_s=3.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    a, b = run(stream, cfg), run(stream, cfg)
    assert [x.as_status() for x in a] == [x.as_status() for x in b]
    status = a[-1].as_status()
    json.dumps(status)
    assert status["prefill"]["desired"] == a[-1].replicas["prefill"] and status["reason"] == a[-1].reason


def test_state_survives_a_json_round_trip():
    import json

    cfg = config()
    stream = steady(0, 12, p=2, d=2, prefill_tok_s=3.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    state = run(stream, cfg)[-1].state
    again = ControllerState.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state
    nxt = obs(180, p=4, d=2, prefill_tok_s=3.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    assert decide(nxt, again, cfg) == decide(nxt, state, cfg)


def test_config_from_the_cluster_spec():
    spec = ClusterSpec.model_validate({"mode": "disaggregated", "prefill": {"minReplicas": 1, "maxReplicas": 6},
                                       "decode": {"replicas": 2, "minReplicas": 2, "maxReplicas": 9},
                                       "ratio": {"min": 0.25, "max": 1.0},
                                       "slo": {"ttftSeconds": 1.5, "itlSeconds": 0.05},
                                       "model": {"tensorParallelSize": 2},
                                       "autoscaling": {"mode": "slo", "gpuBudget": 24, "coldStartSeconds": 90,
                                                       "warmReplicas": 1, "targetUtilization": 0.7}})
    cfg = LawConfig.from_spec(spec, PROFILE)
    b = cfg.bounds
    assert (b.prefill_min, b.prefill_max, b.decode_min, b.decode_max) == (1, 6, 2, 9)
    assert (b.ratio_min, b.ratio_max, b.gpu_budget, b.gpus_per_replica) == (0.25, 1.0, 24, 2)
    assert (cfg.ttft_s, cfg.itl_s, cfg.cold_start_s, cfg.warm_replicas) == (1.5, 0.05, 90.0, 1)
    assert cfg.target_utilization == 0.7 and cfg.low_utilization < 0.7 < cfg.high_utilization


# -- the call rate ---------------------------------------------------------------------------------------
def _every(interval: float, n: int, **kw) -> list[Observation]:
    return [replace(obs(interval * (i + 1), **kw), window_seconds=interval) for i in range(n)]


def test_the_law_s_learning_is_per_second_not_per_call():
    """Called every 5 s instead of 15, the SLO loop's steps and the smoothed prompt length move as far in the same
    time: three 5-s windows missing the objective lower the target as one 15-s window does."""
    miss = dict(p=4, d=2, prefill_tok_s=2.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S, ttft_p90=5.0, queued=2)
    slow = run(_every(15.0, 4, **miss), config(), follow=False)[-1].state
    fast = run(_every(5.0, 12, **miss), config(), follow=False)[-1].state
    assert slow.prefill.slo_factor < 1.0
    assert fast.prefill.slo_factor == pytest.approx(slow.prefill.slo_factor, rel=1e-9)
    assert fast.prefill.mean_input == pytest.approx(slow.prefill.mean_input, rel=1e-9)


def test_called_every_5_s_the_fast_loop_sizes_on_the_last_15_s():
    """A 5-s window of three times the load, between two calm ones, is a third of the last 15 s: the burst is
    sized on that mean, not on the 5-s peak."""
    calm = dict(p=2, d=2, out_tok_s=1.0 * DECODE_TOK_S, prefill_tok_s=1.0 * PREFILL_TOK_S)
    stream = _every(5.0, 2, **calm) + [replace(obs(15.0, p=2, d=2, out_tok_s=1.0 * DECODE_TOK_S,
                                                   prefill_tok_s=7.0 * PREFILL_TOK_S, queue_tokens=100_000,
                                                   queued=100, ttft_p90=4.0), window_seconds=5.0)]
    last = run(stream, config(), follow=False)[-1]
    assert last.prefill.need == pytest.approx(3.0, rel=1e-6)  # (1 + 1 + 7) / 3
    assert last.prefill.action == "up" and last.prefill.desired < 7


def test_a_trough_as_long_as_a_short_scale_down_cooldown_releases_replicas():
    """The need is averaged over a minute, or over `scaleDownCooldownSeconds` when that is shorter: with a 20-s
    cooldown, a load that stops is scaled down to one replica 40 s later, where a minute's mean keeps three."""
    def spec(**autoscaling) -> ClusterSpec:
        return ClusterSpec.model_validate({"mode": "disaggregated", "prefill": {"minReplicas": 1, "maxReplicas": 9},
                                           "autoscaling": {"mode": "slo", "intervalSeconds": 5,
                                                           "plannerIntervalSeconds": 5, **autoscaling}})
    short = LawConfig.from_spec(spec(scaleDownCooldownSeconds=20), PROFILE)
    assert short.smoothing_s == 20.0
    assert LawConfig.from_spec(spec(), PROFILE).smoothing_s == 60.0  # the default cooldown, 300 s
    assert LawConfig.from_spec(spec(scaleDownCooldownSeconds=0), PROFILE).smoothing_s == 5.0  # one window
    load = dict(p=4, d=2, out_tok_s=1.0 * DECODE_TOK_S)
    stream = [replace(obs(5.0 * (i + 1), prefill_tok_s=(3.0 * PREFILL_TOK_S if i < 12 else 0.0), **load),
                      window_seconds=5.0) for i in range(20)]  # a minute of load, then 40 s of none

    assert run(stream, short)[-1].prefill.desired == 1
    assert run(stream, replace(short, smoothing_s=60.0))[-1].prefill.desired == 3
