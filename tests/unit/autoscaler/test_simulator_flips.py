"""Role flips in the simulator: a flipping worker takes no new work, drains what it holds, and serves the other
role `flip_s` after its last request; it keeps its GPUs all along (no new worker, no cold start); a flip can be
called back, and every request still finishes exactly once. The law's own flips and the actuator's rule for laws
that plan none (`flips_between`) both run here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from splitserve.autoscaler.observations import Observation
from splitserve.autoscaler.sim.simulator import Simulation, fresh, simulate
from splitserve.autoscaler.sim.trace import SimRequest, Status
from unit.autoscaler.test_simulator import PROFILE, SETTINGS, CountingSimulation, mixed, slo_law

FLIPPING = replace(SETTINGS, flips=True, flip_s=2.0)


@dataclass
class Script:
    """Wants `targets[k]` from the k-th decision on (the last one after that)."""

    targets: list[tuple[int, int]]
    interval_s: float = 1.0
    name: str = "script"
    kills_on_scale_down: bool = False
    calls: int = field(default=0)

    def decide(self, obs: Observation) -> tuple[int, int, str]:
        p, d = self.targets[min(self.calls, len(self.targets) - 1)]
        self.calls += 1
        return p, d, "script"


def steady(n: int = 40, rate: float = 4.0, output: int = 600) -> list[SimRequest]:
    """Long prompts (remote prefill) at a fixed rate, outputs long enough that decode workers hold requests."""
    return [SimRequest(i, i / rate, 600, output) for i in range(n)]


def test_a_flip_moves_a_worker_without_a_start_and_costs_its_drain_then_the_switch():
    """From 1 prefill + 2 decode, the law wants 2:1 from its second decision: with flips, a decode worker
    drains its requests and serves prefill flip_s after the last one; no worker starts, so the GPU-seconds are
    three workers' over the run. Without flips a prefill worker loads for the cold start and a decode worker
    drains out."""
    law = Script([(1, 2), (2, 1)])
    sim = Simulation(steady(), FLIPPING, law, (1, 2))
    res = sim.run()
    assert all(r.status == Status.FINISHED for r in res.requests)
    assert res.flips == 1 and len(sim.workers) == 3
    moved = next(w for w in sim.workers if w.name.startswith("decode") and w.role == "prefill")
    assert res.gpu_seconds == pytest.approx(3 * res.end_time)
    # its last decode request ended at the drain's end; it served prefill flip_s later
    last = max(r.finish for r in res.requests if r.decode_worker is moved and r.prefill_worker is not moved)
    first_prefill = min((r.prefill_start for r in res.requests if r.prefill_worker is moved), default=None)
    assert first_prefill is not None and first_prefill >= last + FLIPPING.flip_s - 1e-9
    without = simulate(steady(), SETTINGS, Script([(1, 2), (2, 1)]), (1, 2))
    assert without.flips == 0 and without.gpu_seconds != pytest.approx(res.gpu_seconds)


def test_a_flip_called_back_serves_its_own_role_again():
    """The law changes its mind while the worker drains: it is called back (no flip happens) and no worker starts."""
    law = Script([(1, 2), (2, 1), (1, 2)])
    sim = Simulation(steady(), FLIPPING, law, (1, 2))
    res = sim.run()
    assert all(r.status == Status.FINISHED for r in res.requests)
    assert res.flips == 0 and len(sim.workers) == 3
    assert sorted(w.role for w in sim.workers) == ["decode", "decode", "prefill"]


def test_a_loading_worker_is_told_its_new_role_for_free():
    """A worker still loading moves to the other role at no cost: it registers in that role once loaded."""
    law = Script([(1, 2), (2, 2), (1, 3)])  # start a prefill worker, then want it as decode while it loads
    sim = Simulation(steady(), FLIPPING, law, (1, 2))
    res = sim.run()
    assert all(r.status == Status.FINISHED for r in res.requests)
    assert len(sim.workers) == 4 and sim.workers[-1].role == "decode" and res.flips == 0
    assert any(r.decode_worker is sim.workers[-1] for r in res.requests)  # it served decode once loaded


@pytest.mark.parametrize("make_law", [lambda: Script([(1, 2), (3, 1), (1, 3), (2, 2), (3, 1)] * 8, interval_s=3.0),
                                      lambda: slo_law()], ids=["reshaping", "slo"])
def test_every_request_finishes_exactly_once_with_flips(make_law):
    reqs = mixed()
    law = make_law()
    if hasattr(law, "config"):
        law.config = replace(law.config, flips=True, flip_s=2.0)
    sim = CountingSimulation(reqs, FLIPPING, law, (1, 2))
    res = sim.run()
    assert sorted(sim.ends) == list(range(len(reqs)))
    assert set(sim.ends.values()) == {1}
    assert all(r.status == Status.FINISHED for r in res.requests)  # flips drain, never kill
    for w in sim.workers:  # nothing left behind: KV, queues, the router's counts
        assert w.kv_used == 0 and not w.inflight and not w.waiting and not w.decoding and not w.held
        assert w.load.outstanding == 0 and w.load.pending_prefill_blocks == 0 and w.load.decoding_blocks == 0
    if isinstance(law, Script):
        assert res.flips > 3
    assert sum(o.prefill.replicas_flipping + o.decode.replicas_flipping for o in res.observations) >= 0


def test_runs_with_flips_are_deterministic():
    reqs = mixed(300)
    a = simulate(fresh(reqs), FLIPPING, Script([(1, 2), (3, 1), (1, 3)] * 5), (1, 2))
    b = simulate(fresh(reqs), FLIPPING, Script([(1, 2), (3, 1), (1, 3)] * 5), (1, 2))
    assert [r.finish for r in a.requests] == [r.finish for r in b.requests]
    assert (a.gpu_seconds, a.flips) == (b.gpu_seconds, b.flips)


def test_the_profile_gives_the_cold_start_of_the_engine_and_the_flip_time():
    prof = replace(PROFILE, cold_start_seconds={"native": 5.0, "vllm": 40.0}, flip_seconds=1.5)
    s = replace(SETTINGS, profile=prof)
    assert (s.load_s, s.switch_s) == (5.0, 1.5)
    assert replace(s, engine="vllm").load_s == 40.0
    assert replace(s, engine="vllm", cold_start_s=7.0, flip_s=0.5).load_s == 7.0


def test_a_reference_planning_flips_keeps_its_total_and_moves_its_split_a_flip_ahead():
    """The bound's reference with flips: its total follows the plans a cold start ahead (the largest window's
    total, not each role's largest), its split the plans a flip ahead."""
    from splitserve.autoscaler.sim.laws import ForesightLaw

    plans = [(2, 6), (6, 2), (2, 6)]  # the total is 8 throughout; the split swings
    plain = ForesightLaw(plans, window_s=10.0, lead_s=20.0)
    assert plain.at(0.0) == (6, 6)  # each role's largest over the next cold start: 12 replicas
    flipping = ForesightLaw(plans, window_s=10.0, lead_s=20.0, split_plans=plans, split_lead_s=0.0)
    assert [flipping.at(t) for t in (0.0, 10.0, 20.0)] == [(2, 6), (6, 2), (2, 6)]  # 8 throughout
    margin = ForesightLaw(plans, window_s=10.0, lead_s=20.0, margin=(1, 1), split_plans=plans, split_lead_s=0.0)
    assert sum(margin.at(0.0)) == 10 and margin.at(10.0) == (7, 3)
