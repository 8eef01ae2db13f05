"""Role flips in the law, on hand-made metric streams (the toy profile of test_autoscaler_law.py: a prefill
replica computes ~9,900 prompt tokens/s, a decode replica carries 5,000 output tokens/s): the law moves workers
between the roles first where the total is right but the split is wrong, only what the giving role does not
need, only when a flip serves sooner than a start, and within the bounds; starts and stops are for the rest.
"""

from __future__ import annotations

import math

import pytest

from splitserve.autoscaler.bounds import Bounds
from splitserve.autoscaler.flips import flips_between
from splitserve.autoscaler.law import ControllerState, LawConfig, decide
from splitserve.autoscaler.profile import ReplicaProfile
from splitserve.common.config import ClusterResource
from unit.autoscaler.test_autoscaler_law import DECODE_TOK_S, PREFILL_TOK_S, PROFILE, config, obs, run, steady

FLIPS = dict(flips=True, flip_s=5.0)


def prefill_burst(p: int, d: int, flips: bool = True, **kw) -> list:
    """Six calm windows (1 prefill replica's load, 1 decode replica's; too soon for decode's scale-down), then a
    burst of 4 prefill replicas' load with 300k prompt tokens queued: prefill wants ceil((4 + 0.49) / 0.8) = 6."""
    cfg = config(**(FLIPS if flips else {}), **kw)
    calm = steady(0, 6, p=p, d=d, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    burst = [obs(90, p=p, d=d, prefill_tok_s=4.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S,
                 queue_tokens=300_000, queued=300, ttft_p90=4.0)]
    return run(calm + burst, cfg)


def test_the_law_flips_first_when_the_total_is_right_but_the_split_is_wrong():
    """Six decode replicas carry one replica's load (it keeps ceil(1 / 0.9) = 2 below its scale-up threshold):
    the four prefill replicas the burst asks for come from decode by flips, and nothing starts."""
    *calm, burst = prefill_burst(p=2, d=6)
    assert all(d.flip is None for d in calm)
    assert burst.flip is not None
    assert (burst.flip.source, burst.flip.target, burst.flip.workers) == ("decode", "prefill", 4)
    assert burst.replicas == {"prefill": 6, "decode": 2}  # 2 + 4 flipped in, 6 - 4 flipped out: no start
    assert burst.flip.seconds == pytest.approx(100 * 0.002 + 5.0)  # a 100-token output at 2 ms a step, then the switch
    assert burst.as_status()["flip"]["workers"] == 4
    assert "flip" in burst.reason


def test_only_what_the_giving_role_does_not_need_is_flipped_the_rest_starts():
    *_, burst = prefill_burst(p=2, d=4)
    assert burst.flip is not None and burst.flip.workers == 2  # decode keeps 2 of its 4
    assert burst.replicas == {"prefill": 6, "decode": 2}  # 2 flipped in + 2 started


def test_without_flips_the_law_starts_replicas_and_decode_holds():
    *_, burst = prefill_burst(p=2, d=6, flips=False)
    assert burst.flip is None
    assert burst.replicas == {"prefill": 6, "decode": 6}


def test_no_flip_when_a_start_is_as_quick():
    *_, burst = prefill_burst(p=2, d=6, cold_start_s=4.0)  # a flip: 0.2 s of drain + 5 s
    assert burst.flip is None and burst.replicas["decode"] == 6 and burst.replicas["prefill"] > 2


def test_a_flip_stays_within_the_bounds():
    """ratio.max 2: prefill 6 needs decode 3 at least, so one flip fewer."""
    bounds = Bounds(prefill_min=1, prefill_max=50, decode_min=1, decode_max=50, ratio_max=2.0)
    *_, burst = prefill_burst(p=2, d=6, bounds=bounds)
    assert burst.flip is not None and burst.flip.workers == 3
    assert burst.replicas == {"prefill": 6, "decode": 3}


def test_no_flip_from_a_role_under_pressure():
    """Decode misses its ITL objective in the window prefill bursts: it gives nothing."""
    cfg = config(**FLIPS)
    calm = steady(0, 6, p=2, d=6, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    burst = obs(90, p=2, d=6, prefill_tok_s=4.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S,
                queue_tokens=300_000, queued=300, ttft_p90=4.0, itl_p90=0.2)
    last = run([*calm, burst], cfg)[-1]
    assert last.flip is None and last.replicas["decode"] >= 6


def test_decode_takes_prefill_s_spare_the_other_way():
    """Decode's seats fill (its ITL over the objective, 3 replicas' load on 2) while six prefill replicas carry
    one replica's prompts: prefill gives decode what it asks for."""
    cfg = config(**FLIPS)
    calm = steady(0, 6, p=6, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.5 * DECODE_TOK_S)
    short = obs(90, p=6, d=2, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=3.0 * DECODE_TOK_S, itl_p90=0.2,
                d_running=20, d_waiting=30, kv=0.95)
    last = run([*calm, short], cfg)[-1]
    assert last.flip is not None and (last.flip.source, last.flip.target) == ("prefill", "decode")
    grown = last.replicas["decode"] - 2
    assert last.flip.workers == grown and last.replicas["prefill"] == 6 - grown  # all of it by flips
    assert last.replicas["prefill"] >= math.ceil(1.0 / 0.9)


def test_a_flip_is_no_scale_down_for_regret_or_the_cooldowns():
    """A flip is undone in seconds: the giving role's scale-down bookkeeping (the regret that stretches its
    stabilisation window, its learned floor) does not count it."""
    *calm, burst = prefill_burst(p=2, d=6)
    assert burst.decode.action == "down"
    assert burst.state.decode.last_down == calm[-1].state.decode.last_down == -math.inf
    assert burst.state.decode.last_change == calm[-1].state.decode.last_change


def test_flipping_replicas_count_in_their_new_role():
    """Workers flipping in count like starting ones: the next window asks for nothing more, and the SLO loop
    does not wind up while they arrive."""
    cfg = config(**FLIPS)
    *calm, burst = prefill_burst(p=2, d=6)
    state = burst.state
    after = obs(105, p=2, d=2, prefill_tok_s=4.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S,
                queue_tokens=300_000, queued=300, ttft_p90=4.0)
    from dataclasses import replace

    after = replace(after, prefill=replace(after.prefill, replicas_flipping=4))
    nxt = decide(after, state, cfg)
    assert nxt.prefill.current == 6 and nxt.replicas["prefill"] == 6 and nxt.flip is None
    assert nxt.state.prefill.slo_factor == state.prefill.slo_factor


def test_flips_between_targets_of_a_law_that_plans_none():
    assert flips_between((2, 6), (5, 4)) == ("decode", "prefill", 2)
    assert flips_between((2, 6), (5, 2)) == ("decode", "prefill", 3)
    assert flips_between((6, 2), (4, 5)) == ("prefill", "decode", 2)
    assert flips_between((2, 6), (5, 7)) is None and flips_between((2, 6), (1, 5)) is None


def test_the_cold_start_comes_from_the_profile_per_engine_unless_configured():
    profile = ReplicaProfile(name="toy", cost=PROFILE.cost, kv_capacity_tokens=PROFILE.kv_capacity_tokens,
                             kv_bytes_per_token=1, cold_start_seconds={"native": 20.0, "vllm": 150.0},
                             flip_seconds=3.0)

    def law(**autoscaling) -> LawConfig:
        doc = {"apiVersion": "splitserve.dev/v1alpha1", "kind": "SplitServeCluster", "metadata": {"name": "c"},
               "spec": {"engine": autoscaling.pop("engine", "native"), "autoscaling": {"mode": "slo", **autoscaling}}}
        return LawConfig.from_spec(ClusterResource.model_validate(doc).spec, profile)

    assert (law().cold_start_s, law().flips, law().flip_s) == (20.0, False, 3.0)
    assert law(engine="vllm").cold_start_s == 150.0
    assert law(engine="vllm", coldStartSeconds=99.0).cold_start_s == 99.0
    flipping = law(roleFlips=True, flipSeconds=2.0)
    assert (flipping.flips, flipping.flip_s) == (True, 2.0)
    one = ReplicaProfile(name="one", cost=PROFILE.cost, kv_capacity_tokens=1000, kv_bytes_per_token=1,
                         cold_start_seconds={"native": 18.0})
    assert one.cold_start("vllm") == 18.0  # not measured for that engine: the longest start that was


def test_a_profile_of_version_1_reads_its_start_as_native_s():
    data = PROFILE.to_json()
    del data["cold_start_seconds"], data["flip_seconds"]
    data |= {"version": 1, "model_load_seconds": 33.0}
    old = ReplicaProfile.from_json(data)
    assert old.cold_start("native") == 33.0 and old.flip_seconds == 5.0
    with pytest.raises(ValueError, match="cold_start_seconds"):
        ReplicaProfile.from_json(PROFILE.to_json() | {"cold_start_seconds": {"native": -1}})


def test_the_decision_is_deterministic_with_flips():
    stream = steady(0, 10, p=2, d=6, prefill_tok_s=1.0 * PREFILL_TOK_S, out_tok_s=1.0 * DECODE_TOK_S)
    cfg = config(**FLIPS)
    a = [d.flip for d in run(stream, cfg)]
    b = [d.flip for d in run(stream, cfg)]
    assert a == b
    assert decide(stream[0], ControllerState(), cfg) == decide(stream[0], ControllerState(), cfg)
