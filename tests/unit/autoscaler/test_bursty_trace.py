"""The generated bursty, prefill-heavy trace (autoscaler/sim/bursty.py): deterministic by seed, bursts where it
says they are, prefill-heavy in them; and the SLO law answering its bursts in the simulator (a short slice)."""

from __future__ import annotations

import pytest

from splitserve.autoscaler.bounds import Bounds
from splitserve.autoscaler.law import LawConfig
from splitserve.autoscaler.profile import PROFILE_DIR, ReplicaProfile
from splitserve.autoscaler.sim import bursty, trace
from splitserve.autoscaler.sim.laws import SLOLaw, StaticLaw
from splitserve.autoscaler.sim.simulator import SimSettings, simulate


def test_same_seed_same_trace_other_seed_other_trace():
    cfg = bursty.BurstyConfig(duration_s=900)
    a, b = bursty.generate(cfg, seed=3), bursty.generate(cfg, seed=3)
    assert a == b
    other, _ = bursty.generate(cfg, seed=4)
    assert [r.arrival for r in other[:50]] != [r.arrival for r in a[0][:50]]
    assert all(x.arrival <= y.arrival for x, y in zip(a[0], a[0][1:], strict=False))
    assert 0 <= a[0][0].arrival and a[0][-1].arrival < 900


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bursts_carry_several_times_the_base_rate_with_longer_prompts(seed):
    cfg = bursty.BurstyConfig()
    rows, found = bursty.generate(cfg, seed)
    assert 5 <= len(found) <= 25  # one every 5 min on average over an hour
    inside = [r for r in rows if any(b.start <= r.arrival < b.start + b.length for b in found)]
    outside = [r for r in rows if not any(b.start <= r.arrival < b.start + b.length for b in found)]
    burst_time = sum(min(b.length, cfg.duration_s - b.start) for b in found)
    in_rate = len(inside) / burst_time
    out_rate = len(outside) / (cfg.duration_s - burst_time)
    assert in_rate > 2.0 * out_rate  # bursts add 1.5-4x the base rate on top of it
    mean_in = sum(r.prompt for r in inside) / len(inside)
    mean_out = sum(r.prompt for r in outside) / len(outside)
    assert mean_in > 1.5 * mean_out  # prefill-heavy bursts
    assert sum(r.output for r in rows) < 0.2 * sum(r.prompt for r in rows)  # short outputs


def test_tags_name_each_rows_burst_and_scaled_copies_name_their_row():
    """What the bound's references plan from: which burst brought each row (-1: the base stream), and which row
    each request of a rate-scaled replay copies."""
    cfg = bursty.BurstyConfig(duration_s=1800)
    rows, found, tags = bursty.generate_tagged(cfg, seed=1)
    assert (rows, found) == bursty.generate(cfg, seed=1)
    assert len(tags) == len(rows) and set(tags) == {-1, *range(len(found))}
    for r, tag in zip(rows, tags, strict=True):
        if tag >= 0:
            assert found[tag].start <= r.arrival < found[tag].start + found[tag].length
    requests = trace.scale(rows, rate_scale=2.5, seed=3)
    sources = trace.scale_sources(rows, rate_scale=2.5, seed=3)
    assert len(sources) == len(requests) and len(set(sources)) == len(rows)
    for q, k in zip(requests, sources, strict=True):
        assert (q.prompt, q.output) == (rows[k].prompt, rows[k].output) and q.arrival >= rows[k].arrival


def test_clumps_are_the_runs_of_bins_well_above_the_mean():
    """A base of one 100-token prompt a second and two clumps (10 s and 20 s of 1,000-token prompts, 5 a second):
    at 5-s bins the clumps are found where they are, as long as they are, with every request in their bins. On the
    generated trace (15-s bins) every burst starts in a clump and every clump starts in a burst."""
    base = [(float(t), 100) for t in range(300)]
    burst = [(s + i / 5, 1000) for s, n in ((100.0, 50), (200.0, 100)) for i in range(n)]
    reqs = [trace.SimRequest(i, t, p, 10) for i, (t, p) in enumerate(sorted(base + burst))]
    found = trace.clumps(reqs, 5.0)
    assert [(c.start, c.length_s, c.requests) for c in found] == [(100.0, 10.0, 60), (200.0, 20.0, 120)]
    assert trace.clumps(reqs, 5.0, factor=1000.0) == [] and trace.clumps([], 5.0) == []
    rows, bursts = bursty.generate(bursty.BurstyConfig(max_prompt=131072), seed=0)
    requests = [trace.SimRequest(i, r.arrival, r.prompt, r.output) for i, r in enumerate(rows)]
    spans = [(c.start, c.start + c.length_s) for c in trace.clumps(requests, 15.0)]
    assert all(any(a - 30 <= b.start < z for a, z in spans) for b in bursts), (spans, bursts)
    assert all(any(b.start - 30 <= a < b.start + b.length for b in bursts) for a, _ in spans), (spans, bursts)


def test_invalid_config_names_the_field():
    with pytest.raises(ValueError, match="base_rate"):
        bursty.BurstyConfig(base_rate=0)
    with pytest.raises(ValueError, match="burst_s"):
        bursty.BurstyConfig(burst_s=(50.0, 10.0))


def test_the_law_answers_the_bursts_from_the_prefill_backlog():
    """Fifteen minutes of the bursty trace (x4) on the 8B-shaped H200 profile, from 1 prefill + 1 decode: within
    two control intervals of each burst's start the law asks for more prefill (it reads the queue, not only
    latency), and it serves more requests in time than the static 1:1 it started from."""
    profile = ReplicaProfile.load(PROFILE_DIR / "h200_8b.json")
    rows, found = bursty.generate(bursty.BurstyConfig(duration_s=900), seed=3)
    settings = SimSettings(profile, bounds=Bounds(prefill_min=1, prefill_max=16, decode_min=1, decode_max=16),
                           join_quantum_s=0.02, cold_start_s=60.0)  # the law's default cold start, simulated
    law = simulate(trace.scale(rows, rate_scale=4, seed=0), settings,
                   SLOLaw(LawConfig(profile=profile, bounds=settings.bounds, cold_start_s=60.0)), (1, 1))
    static = simulate(trace.scale(rows, rate_scale=4, seed=0), settings, StaticLaw(1, 1), (1, 1))
    assert found
    for b in found:
        before = max((p for p in law.timeline if p.time <= b.start), key=lambda p: p.time, default=None)
        soon = [p for p in law.timeline if b.start < p.time <= b.start + 30 + 2 * 15]
        if before is None or not soon:
            continue
        wanted = max(p.prefill["desired"] for p in soon)
        assert wanted > before.prefill["desired"] or before.prefill["desired"] >= 4, (b, before.prefill)
    assert law.attainment() > static.attainment() + 0.05
