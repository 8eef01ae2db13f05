"""The simulator: every request finishes exactly once (also across scale-ups, drains and kills), runs are
deterministic, single requests take exactly the profile's times, the router's real policy spreads the load,
the macro-step arithmetic matches step-by-step, and the calibration fits report their errors (the CLI's JSON
contract: tests/e2e/test_simulator_cli.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from splitserve.autoscaler.bounds import Bounds
from splitserve.autoscaler.law import LawConfig
from splitserve.autoscaler.observations import Observation, RoleObservation
from splitserve.autoscaler.profile import PROFILE_DIR, ReplicaProfile, StepCost, attn_pairs
from splitserve.autoscaler.sim import trace
from splitserve.autoscaler.sim.calibrate import (
    StepPoint,
    fit_errors,
    fit_gpu_profile,
    fit_points,
    kv_case,
    measured_prefill_steps,
)
from splitserve.autoscaler.sim.laws import DynamoLoadLaw, ForesightLaw, LateOracleLaw, SLOLaw, StaticLaw
from splitserve.autoscaler.sim.report import summary
from splitserve.autoscaler.sim.simulator import SimSettings, Simulation, fresh, simulate
from splitserve.autoscaler.sim.trace import SimRequest, Status
from splitserve.autoscaler.sim.worker import WorkerState, _Step

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
TRACES = ROOT.parent / "shared" / "traces"

# a small replica: 2 ms + 0.05 ms/token per step, 40k tokens of KV, 16 seats
COST = StepCost(base_s=0.002, per_seq_s=0.0001, per_token_s=0.00005, knee_tokens=20.0, per_ctx_token_s=1e-7,
                per_attn_pair_s=1e-9)
PROFILE = ReplicaProfile(name="toy", cost=COST, kv_capacity_tokens=40_000, kv_bytes_per_token=1000,
                         max_num_seqs=16, max_num_batched_tokens=512, kv_transfer_gbps=1.0,
                         kv_transfer_tail_s=0.002, cold_start_seconds={"native": 5.0})
SETTINGS = SimSettings(PROFILE, ttft_s=1.0, itl_s=0.05, disagg_threshold=256, drain_seconds=30.0)


def mixed(n: int = 600, rate: float = 20.0, seed: int = 1) -> list[SimRequest]:
    """Poisson arrivals, prompts 32..2000 tokens (some prefilled locally), outputs 1..120 tokens."""
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        burst = 4.0 if 150 <= i < 300 else 1.0  # a burst: the law scales up, then down in the calm after it
        t += rng.expovariate(rate * burst)
        out.append(SimRequest(i, t, rng.randint(32, 2000), rng.randint(1, 120)))
    return out


def slo_law(interval: float = 1.0) -> SLOLaw:
    cfg = LawConfig(PROFILE, Bounds(prefill_min=1, prefill_max=8, decode_min=1, decode_max=8), ttft_s=1.0, itl_s=0.05,
                    scale_up_cooldown_s=2.0, scale_down_cooldown_s=4.0, planner_interval_s=2.0, cold_start_s=5.0,
                    trend_window_s=10.0, smoothing_s=2.0)
    return SLOLaw(cfg, interval_s=interval)


class CountingSimulation(Simulation):
    """Counts how often each request is ended."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ends: dict[int, int] = {}

    def _end(self, req, now, status) -> None:
        self.ends[req.rid] = self.ends.get(req.rid, 0) + 1
        super()._end(req, now, status)


@pytest.mark.parametrize("make_law", [lambda: StaticLaw(1, 2), slo_law, lambda: DynamoLoadLaw(PROFILE, 1.0, 0.05)],
                         ids=["static", "slo", "dynamo-kills"])
def test_every_request_finishes_exactly_once(make_law):
    reqs = mixed()
    sim = CountingSimulation(reqs, SETTINGS, make_law(), (1, 2))
    res = sim.run()
    assert sorted(sim.ends) == list(range(len(reqs)))
    assert set(sim.ends.values()) == {1}
    assert all(r.status in (Status.FINISHED, Status.FAILED) for r in res.requests)
    for r in res.requests:
        if r.status == Status.FINISHED:
            assert r.arrival <= r.first_token <= r.finish
            assert r.generated + 0 >= 1
    for w in sim.workers:  # nothing left behind: KV, queues, the router's counts
        assert w.kv_used == 0 and not w.inflight and not w.waiting and not w.decoding
        assert w.load.outstanding == 0 and w.load.pending_prefill_blocks == 0 and w.load.decoding_blocks == 0
    if isinstance(sim.law, SLOLaw):
        assert all(r.status == Status.FINISHED for r in res.requests)  # drains, never kills
        sizes = [p.prefill["ready"] + p.decode["ready"] for p in res.timeline]
        assert max(sizes) > 3 and sizes[-1] < max(sizes), "the burst should scale up, the calm after it down"


def test_kills_fail_requests_where_drains_do_not():
    reqs = mixed()
    dyn = simulate(fresh(reqs), SETTINGS, DynamoLoadLaw(PROFILE, 1.0, 0.05), (4, 4))
    ours = simulate(fresh(reqs), SETTINGS, slo_law(), (4, 4))
    assert sum(r.status == Status.FAILED for r in ours.requests) == 0
    assert any(p.prefill["ready"] + p.decode["ready"] < 8 for p in ours.timeline)  # it did scale down
    assert summary(dyn)["failed"] >= 0  # (kills are allowed to fail requests; counted, never lost)


def test_every_laws_wish_is_clamped_into_the_bounds():
    from dataclasses import replace

    greedy = StaticLaw(10, 10, interval_s=1.0)  # wants 20 GPUs
    bounded = replace(SETTINGS, bounds=Bounds(prefill_min=1, prefill_max=8, decode_min=1, decode_max=8, gpu_budget=6))
    res = simulate(mixed(200), bounded, greedy, (1, 2))
    assert max(p.gpus for p in res.timeline) <= 6
    assert all("gpuBudget" in p.reason for p in res.timeline)


def test_the_late_oracle_holds_the_largest_plan_of_the_windows_before():
    """The reference for what reading the past better could give: in window k, the largest of the oracle's plans for
    the `span` windows before k (window 0: the oracle's first plan, where every law starts), at least 1 replica;
    the simulator runs it like any law, its scale-ups loading for the cold start."""
    plans = [(4, 2), (1, 5), (3, 1), (0, 0), (2, 2)]
    late = LateOracleLaw(plans, window_s=10.0, span=2)

    def at(t: float) -> tuple[int, int]:
        p, d, _ = late.decide(Observation(t, 1.0, RoleObservation("prefill", 1), RoleObservation("decode", 1)))
        return p, d

    assert [at(t) for t in (0.0, 9.9, 10.0, 25.0, 35.0, 45.0, 99.0)] == [
        (4, 2), (4, 2), (4, 2), (4, 5), (3, 5), (3, 1), (2, 2)]
    assert LateOracleLaw(plans, 10.0, span=len(plans)).decide(
        Observation(45.0, 1.0, RoleObservation("prefill", 1), RoleObservation("decode", 1)))[:2] == (4, 5)
    res = simulate(fresh(mixed(200)), SETTINGS, LateOracleLaw([(1, 1), (3, 2)], window_s=5.0, interval_s=1.0), (1, 1))
    assert max(pt.prefill["ready"] + pt.prefill["starting"] for pt in res.timeline) == 3


def test_the_foresight_reference_scales_up_a_cold_start_ahead_and_down_on_time():
    """The bound's reference: a window's plan (plus the standing margin) is asked for a cold start before the
    window begins, so its replicas are ready when it does, and kept until a window that needs fewer begins."""
    plans = [(1, 1), (1, 1), (4, 3), (1, 2), (1, 1)]
    ahead = ForesightLaw(plans, window_s=10.0, lead_s=15.0, margin=(1, 0))

    def at(t: float) -> tuple[int, int]:
        p, d, _ = ahead.decide(Observation(t, 1.0, RoleObservation("prefill", 1), RoleObservation("decode", 1)))
        return p, d

    assert [at(t) for t in (0.0, 4.9, 5.0, 19.9, 29.9, 30.0, 35.0, 99.0)] == [
        (2, 1), (2, 1), (5, 3), (5, 3), (5, 3), (2, 2), (2, 2), (2, 1)]
    res = simulate(fresh(mixed(200)), SETTINGS,
                   ForesightLaw([(1, 1), (1, 1), (3, 2)], window_s=4.0, lead_s=PROFILE.cold_start("native"),
                                interval_s=1.0), (1, 1))
    ready = [(pt.time, pt.prefill["ready"]) for pt in res.timeline]
    assert any(n == 3 for t, n in ready if t <= 8.0 + 1.0)  # loaded by the time window 2 begins (1 s decisions)


def test_same_inputs_same_run():
    a = simulate(mixed(seed=3), SETTINGS, slo_law(), (1, 2))
    b = simulate(mixed(seed=3), SETTINGS, slo_law(), (1, 2))
    assert [(r.first_token, r.finish, r.slow_itls) for r in a.requests] == \
        [(r.first_token, r.finish, r.slow_itls) for r in b.requests]
    assert [(p.time, p.prefill, p.decode) for p in a.timeline] == [(p.time, p.prefill, p.decode) for p in b.timeline]
    c = simulate(mixed(seed=4), SETTINGS, slo_law(), (1, 2))
    assert [r.finish for r in c.requests] != [r.finish for r in a.requests]


def test_trace_scaling_is_seeded():
    rows = [trace.TraceRow(float(i), 100 + i, 10) for i in range(50)]
    a, b = trace.scale(rows, rate_scale=2.5, seed=7), trace.scale(rows, rate_scale=2.5, seed=7)
    assert [(r.arrival, r.prompt) for r in a] == [(r.arrival, r.prompt) for r in b]
    assert 100 <= len(a) <= 150
    assert [(r.arrival, r.prompt) for r in trace.scale(rows, rate_scale=2.5, seed=8)] != [(r.arrival, r.prompt) for r in a]


def test_one_remote_request_takes_exactly_the_profiles_times():
    req = SimRequest(0, 0.0, 1000, 4)
    res = simulate([req], SETTINGS, StaticLaw(1, 1), (1, 1))
    r = res.requests[0]
    # prefill: chunks of 512 then 488 tokens; KV lands max(end + tail, start + bytes / bandwidth)
    t1 = COST.seconds(1, 512, 0, attn_pairs(512, 0))
    t2 = COST.seconds(1, 488, 0, attn_pairs(488, 512))
    land = max(t1 + t2 + PROFILE.kv_transfer_tail_s, PROFILE.kv_transfer_seconds(1000))
    assert r.ttft == pytest.approx(land, rel=1e-9)
    # then three decode steps of one sequence whose context grows 1001, 1002, 1003
    steps = [COST.decode_seconds(1, 1001 + j) for j in range(3)]
    assert r.finish == pytest.approx(land + sum(steps), rel=1e-9)
    assert r.remote and r.status == Status.FINISHED and r.slow_itls == 0


def test_short_prompts_prefill_on_the_decode_worker():
    res = simulate([SimRequest(0, 0.0, 100, 2)], SETTINGS, StaticLaw(1, 1), (1, 1))
    r = res.requests[0]
    assert not r.remote
    assert r.ttft == pytest.approx(COST.seconds(1, 100, 0, attn_pairs(100, 0)))


def test_prefix_caches_shorten_repeated_prompts():
    first = SimRequest(0, 0.0, 1024, 3, (11, 12), 512)
    again = SimRequest(1, 5.0, 1024, 3, (11, 12), 512)  # the same prompt once the first is done
    other = SimRequest(2, 10.0, 1024, 3, (21, 22), 512)
    res = simulate([first, again, other], SETTINGS, StaticLaw(1, 1), (1, 1))
    a, b, c = res.requests
    assert a.remote and c.remote
    # the decode worker holds the first prompt's KV: it computes the one last token itself
    assert not b.remote and b.cached == 1023
    assert b.ttft < a.ttft / 5 and c.ttft == pytest.approx(a.ttft, rel=0.01)


def test_the_routers_least_loaded_policy_spreads_requests():
    reqs = [SimRequest(i, i * 0.001, 600, 50) for i in range(40)]
    no_spill = dataclasses.replace(SETTINGS, spill_prefill_tokens=0)  # every prompt to a prefill worker
    res = simulate(reqs, no_spill, StaticLaw(2, 3), (2, 3))
    by_decode: dict[str, int] = {}
    by_prefill: dict[str, int] = {}
    for r in res.requests:
        by_decode[r.decode_worker.name] = by_decode.get(r.decode_worker.name, 0) + 1
        by_prefill[r.prefill_worker.name] = by_prefill.get(r.prefill_worker.name, 0) + 1
    assert len(by_decode) == 3 and max(by_decode.values()) - min(by_decode.values()) <= 1
    assert len(by_prefill) == 2


def test_kv_capacity_limits_the_decode_batch_and_preempts():
    small = ReplicaProfile(**{**PROFILE.__dict__, "kv_capacity_tokens": 6000})
    reqs = [SimRequest(i, 0.0, 900, 200) for i in range(8)]  # 8 x 1100 tokens do not fit 6000
    res = simulate(reqs, SimSettings(small, ttft_s=1.0, itl_s=0.05, disagg_threshold=256), StaticLaw(1, 1), (1, 1))
    assert all(r.status == Status.FINISHED for r in res.requests)
    assert max(r.finish for r in res.requests) > 2 * min(r.finish for r in res.requests)  # they took turns


def _full_decode(capacity: int = 6000) -> tuple[ReplicaProfile, SimSettings]:
    small = ReplicaProfile(**{**PROFILE.__dict__, "kv_capacity_tokens": capacity})
    return small, SimSettings(small, ttft_s=1.0, itl_s=0.05, disagg_threshold=256, reserve_wait_s=0.5,
                              queue_timeout_s=5.0)


def test_a_long_prompt_without_kv_room_waits_for_it_and_is_prefilled_remotely():
    """As decode_worker/service.py: a decode worker never prefills a long prompt itself for want of KV. The
    second prompt finds the KV held by the first (5,000 of 6,000 tokens). It waits, is sent back as busy every
    `reserve_wait_s` and offered again after the busy pause (the only decode worker), and once the first
    finishes it goes to the prefill worker. The simulator used to prefill it on the decode worker at once."""
    _, settings = _full_decode()
    reqs = [SimRequest(0, 0.0, 4000, 1000), SimRequest(1, 0.01, 3000, 10)]
    sim = Simulation(reqs, settings, StaticLaw(1, 1), (1, 1))
    res = sim.run()
    first, second = res.requests
    assert first.status == second.status == Status.FINISHED
    assert first.remote and second.remote, "both prompts are computed by the prefill worker"
    assert second.prefill_worker.role == "prefill"
    assert second.prefill_start >= first.finish > 3.0  # it waited for the first's KV to go
    assert second.bounces == math.floor((first.finish - 0.01) / (settings.reserve_wait_s + 0.05))


def test_a_prompt_still_without_room_after_the_wait_goes_to_another_decode_worker():
    """After `reserve_wait_s` the decode worker sends it back as busy; the router's policy offers it to another
    decode worker, which has room."""
    _, settings = _full_decode()

    class FirstDecodeFull(Simulation):
        def _arrive(self, req, now, exclude=frozenset()):
            if req.rid == 1 and not exclude:  # the least-loaded pick would be the empty worker: force the full one
                exclude = frozenset(w.name for w in self.live["decode"] if not w.inflight)
                super()._arrive(req, now, exclude)
                return
            super()._arrive(req, now, exclude)

    reqs = [SimRequest(0, 0.0, 4000, 1000), SimRequest(1, 0.01, 3000, 10)]
    res = FirstDecodeFull(reqs, settings, StaticLaw(1, 2), (1, 2)).run()
    first, second = res.requests
    assert second.status == Status.FINISHED and second.remote
    assert second.bounces == 1 and second.busy_since == pytest.approx(0.51)
    assert second.decode_worker is not first.decode_worker
    assert second.first_token < first.finish  # it did not wait for the first request to end


def test_a_prompt_whose_prefill_worker_left_while_it_waited_is_prefilled_on_its_decode_worker():
    """The prefill pool goes to zero while the second prompt waits for KV room (a wait longer than the first
    request's decode): once room frees there is no prefill worker to send it to, so its decode worker computes
    it, with the KV it reserved given back first (the cache's count stays exact)."""
    _, settings = _full_decode()
    settings = dataclasses.replace(settings, reserve_wait_s=30.0)
    reqs = [SimRequest(0, 0.0, 4000, 1000), SimRequest(1, 0.01, 3000, 10)]
    sim = Simulation(reqs, settings, StaticLaw(0, 1, interval_s=0.5), (1, 1))
    res = sim.run()
    first, second = res.requests
    assert first.remote and not second.remote
    assert second.status == Status.FINISHED and second.bounces == 0
    assert second.first_token > first.finish
    decode = next(w for w in sim.workers if w.role == "decode")
    assert decode.kv_used == 0 and not decode.room


def test_a_prompt_whose_own_prefill_worker_left_is_prefilled_on_its_decode_worker_not_another():
    """As decode_worker/service.py does (its call to a prefill worker that has left fails, and it prefills
    locally): the prefill worker the router picked for the waiting prompt leaves before room frees, another
    prefill worker is ready, and the decode worker computes the prompt. The simulator used to send it to the
    other prefill worker, a choice no part of the real cluster makes."""
    _, settings = _full_decode()
    settings = dataclasses.replace(settings, reserve_wait_s=30.0)
    left: list[str] = []

    class PrefillLeaves(Simulation):
        def _room(self, dec, now):
            for req in dec.room:
                if req.prefill_worker is not None and req.prefill_worker.state == WorkerState.READY:
                    left.append(req.prefill_worker.name)
                    self._retire(req.prefill_worker, now)
            super()._room(dec, now)

    reqs = [SimRequest(0, 0.0, 4000, 1000), SimRequest(1, 0.01, 3000, 10)]
    sim = PrefillLeaves(reqs, settings, StaticLaw(2, 1), (2, 1))
    res = sim.run()
    first, second = res.requests
    assert left and first.prefill_worker.name not in left, "the first prompt's prefill worker stays"
    assert first.remote and not second.remote
    assert second.status == Status.FINISHED and second.first_token > first.finish
    assert [w.name for w in sim.live["prefill"]] == [first.prefill_worker.name]
    decode = next(w for w in sim.workers if w.role == "decode")
    assert decode.kv_used == 0 and not decode.room


def test_a_prompt_that_never_finds_room_fails_after_the_queue_timeout():
    """One decode worker whose KV a long request holds for longer than the queue timeout: the second request
    bounces (offered again after the busy pause each time) and fails at the timeout, not at the end of time."""
    _, settings = _full_decode()
    reqs = [SimRequest(0, 0.0, 4000, 1900), SimRequest(1, 0.01, 3000, 10)]  # the first decodes for > 5 s
    res = simulate(reqs, dataclasses.replace(settings, itl_s=1.0), StaticLaw(1, 1), (1, 1))
    first, second = res.requests
    assert first.status == Status.FINISHED and first.finish > 6.0
    assert second.status == Status.FAILED
    assert 5.0 <= second.finish - second.busy_since <= 5.0 + settings.reserve_wait_s + 0.1
    assert second.bounces >= 5


@pytest.mark.parametrize("a0,delta,k", [(0.01, 0.0, 5), (0.01, 0.001, 40), (0.2, 0.003, 17)])
def test_macro_step_arithmetic_matches_step_by_step(a0, delta, k):
    s = _Step(10.0, k, a0, delta, 4, [])
    ends = [sum(a0 + delta * i for i in range(j)) for j in range(1, k + 1)]
    for j, end in enumerate(ends, start=1):
        assert s.duration(j) == pytest.approx(end)
        assert s.steps_by(end - 1e-9) == j and s.steps_by(end + 1e-9) == min(k, j + 1) or j == k
    limit = a0 + delta * (k // 2 + 0.37)  # between two steps (a tie would test float rounding)
    assert s.slow_steps(limit) == sum(a0 + delta * i > limit for i in range(k))


# -- calibration ----------------------------------------------------------------------------------------------
def test_fit_recovers_a_known_step_cost():
    points = [StepPoint.decode(b, c, COST.decode_seconds(b, b * c)) for b in (1, 4, 16, 64) for c in (100, 1000)]
    points += [StepPoint.prefill(n, COST.seconds(1, n, 0, attn_pairs(n, 0))) for n in (64, 256, 1024, 4096)]
    fitted = fit_points(points)
    assert max(abs(e["error"]) for e in fit_errors(fitted, points)) < 0.02


def test_gpu_fit_reproduces_the_committed_measurements_and_reports_its_errors():
    gpu = json.loads((RESULTS / "gpu_engine_nvidia_h200.json").read_text())
    kv = kv_case(RESULTS / "kv_transfer_nixl_cuda_2xh200.txt", "llama8b_3k")
    prof = fit_gpu_profile(gpu, kv)
    errors = prof.source["errors"]
    assert len(errors) == len(gpu["decode"]) + len(gpu["prefill"])
    assert max(abs(e["error"]) for e in errors) < 0.05
    steps_file = RESULTS / "sim_calibration_h200_8b_steps.json"
    if steps_file.exists():  # with the measured chunked prefill steps: what the benchmark reads
        steps = measured_prefill_steps(steps_file)
        prof = fit_gpu_profile(gpu, kv, prefill_steps=steps)
        errors = prof.source["errors"]
        assert len(errors) == len(gpu["decode"]) + len(gpu["prefill"]) + len(steps)
        assert max(abs(e["error"]) for e in errors) < 0.2
        assert sum(abs(e["error"]) for e in errors) / len(errors) < 0.06
    committed = PROFILE_DIR / "h200_8b.json"
    if committed.exists():  # the file the benchmark reads is this very fit, to the last few bits (the least
        # squares' last bit moves with numpy's build; any real change of a coefficient is far above 1e-9)
        got, want = dataclasses.asdict(prof.cost), dataclasses.asdict(ReplicaProfile.load(committed).cost)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_cpu_calibration_reports_fit_and_validation_errors():
    path = PROFILE_DIR / "cpu2_smollm2.json"
    if not path.exists():
        pytest.skip("no CPU calibration committed yet (splitserve simulate --calibrate)")
    prof = ReplicaProfile.load(path)
    errors = prof.source["errors"]
    assert errors and all(math.isfinite(e["error"]) for e in errors)
    validation = RESULTS / "sim_calibration_validation_cpu2.json"
    if validation.exists():  # simulated against measured, per case, per way of using the profile
        v = json.loads(validation.read_text())
        assert {c["name"] for c in v["cases"]} == {"poisson", "mooncake_slice"}
        for case in v["cases"]:
            for variant in ("raw_profile", "decode_fitted", "both_fitted"):
                for key in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s"):
                    m = case[variant][key]
                    assert m["error"] == pytest.approx(m["simulated"] / m["measured"] - 1, abs=1e-3)
        assert set(v["held_out_max_abs_error"]) == {"raw_profile", "decode_fitted", "both_fitted"}


# -- traces and the CLI --------------------------------------------------------------------------------------
@pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not here")
def test_reading_the_shared_traces():
    for name, hashed in (("azure_conv_2023.csv", False), ("mooncake_conversation.jsonl", True)):
        rows = trace.read_trace(TRACES / name, max_input=4096, max_output=256)
        assert rows[0].arrival == 0.0 and all(a.arrival <= b.arrival for a, b in zip(rows, rows[1:], strict=False))
        assert max(r.prompt for r in rows) <= 4096 and max(r.output for r in rows) <= 256
        assert bool(rows[0].hash_ids) == hashed
    half = trace.scale(rows, time_scale=0.5, duration_s=600)
    assert half[-1].arrival <= 300.0
