"""The control law's state survives the operator: it lives in the SplitServeCluster's status.lawState (versioned
JSON, autoscaler/law_state.py), and a restarted operator continues from it. Run against kmock's Kubernetes
emulator, which stands in for the API server (no API server can run here); the observations come from a real
redis-server registry and a metrics server, as in test_operator_autoscale.py."""

from __future__ import annotations

import copy
import json
import math

import pytest
from unit.hosts.test_operator_kmock import CLUSTERS, cluster_doc, eventually, live

from e2e.test_autoscaler_observer import entry, register
from e2e.test_operator_autoscale import (  # noqa: F401
    CLUSTER_PATH,
    QUEUE_TOKENS,
    SPEC,
    Operator,
    api,
    deployments,
    queue_on_prefill,
    sources,
)
from splitserve.autoscaler.law_state import STATE_VERSION, ControllerState, RoleState
from splitserve.hosts.k8s.slo import SloReplicas

pytestmark = pytest.mark.slow


def law_state(emulator) -> dict | None:
    return (live(emulator, CLUSTERS).get("llm", {}).get("status") or {}).get("lawState")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_restarted_operator_continues_the_law_from_status(api, sources):  # noqa: F811
    """kmock emulates the API server. Mid-trace: a prefill queue makes the law scale prefill 1 -> 2, and the
    scale-up stamps its cooldown (10 min) into status.lawState. The operator stops; the second replica becomes
    ready with the queue still long (a burst the law would answer with a third replica). A new operator, with
    no memory of its own, reads status.lawState: the cooldown still holds, prefill stays at 2, and the law's
    history holds the windows observed before the restart. (Without the state, the new law would scale at once.)"""
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"]["scaleUpCooldownSeconds"] = 600
    queue_on_prefill(sources)
    async with Operator(str(api.url), SloReplicas(observers=sources.observer)):
        resp = await api.post(CLUSTER_PATH, json=cluster_doc("llm", spec))
        assert resp.status == 200, await resp.text()
        await eventually(lambda: deployments(api).get("llm-prefill") == 2, timeout=30, what="prefill scaled to 2")
        await eventually(lambda: (law_state(api) or {}).get("prefill", {}).get("last_up") is not None, timeout=30,
                         what="the scale-up in status.lawState")
    kept = law_state(api)
    assert kept["version"] == STATE_VERSION
    before = ControllerState.from_json(kept)
    assert before.prefill.last_up > 0 and before.prefill.history
    first_seen = before.prefill.history[0][0]

    # while no operator runs: the new replica is ready, the queue is still long (a burst on 2 replicas)
    register(sources.client, entry("llm-prefill-b", "prefill", 5003, "", num_waiting=40,
                                   waiting_prefill_tokens=QUEUE_TOKENS, num_running=1))
    restarted = SloReplicas(observers=sources.observer)
    async with Operator(str(api.url), restarted):
        await eventually(lambda: "scale-up cooldown" in live(api, CLUSTERS)["llm"]["status"]["lastDecision"]["reason"],
                         timeout=30, what="the restarted law holding for the cooldown it inherited")
        after = ControllerState.from_json(law_state(api))
        assert deployments(api)["llm-prefill"] == 2
        assert after.prefill.last_up == pytest.approx(before.prefill.last_up)
        assert after.prefill.history[0][0] <= first_seen + 1e-6  # windows from before the restart are kept
        assert len(after.prefill.history) > len(before.prefill.history)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_state_this_law_cannot_read_is_dropped_and_the_law_starts_afresh(api, sources, caplog):  # noqa: F811
    """kmock emulates the API server. A status.lawState of another version is not guessed at: the law starts
    afresh (it scales the burst at once, no inherited cooldown) and status gets a state of this version."""
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"]["scaleUpCooldownSeconds"] = 600
    queue_on_prefill(sources)
    doc = cluster_doc("llm", spec)
    old = ControllerState(prefill=RoleState(last_up=1e12, last_change=1e12)).to_json() | {"version": 999}
    doc["status"] = {"lawState": old}
    async with Operator(str(api.url), SloReplicas(observers=sources.observer)):
        resp = await api.post(CLUSTER_PATH, json=doc)
        assert resp.status == 200, await resp.text()
        await eventually(lambda: deployments(api).get("llm-prefill") == 2, timeout=30, what="prefill scaled to 2")
        await eventually(lambda: (law_state(api) or {}).get("version") == STATE_VERSION, timeout=30,
                         what="a state of this version in status")
    assert any("not restored" in r.getMessage() and "version 999" in r.getMessage() for r in caplog.records)


def test_state_json_round_trips_and_refuses_what_it_cannot_read():
    state = ControllerState(prefill=RoleState(last_up=12.5, history=((0.0, 1.5), (15.0, 2.0)), planned=2.0,
                                              recent=((15.0, 3),), hold_s=600.0, peak_need=4.0),
                            load=((0.0, 1200.0), (15.0, 900.5)))
    text = json.dumps(state.to_json(), allow_nan=False)  # no Infinity: "never" is null
    again = ControllerState.from_json(json.loads(text))
    assert again == state
    assert math.isinf(again.decode.last_up) and again.decode.planned is None
    good = state.to_json()
    for bad, what in (({**good, "version": STATE_VERSION + 1}, "version"),
                      ({**good, "extra": 1}, "unknown keys"),
                      ({**good, "prefill": {**good["prefill"], "typo": 1}}, "unknown fields"),
                      ({**good, "prefill": {**good["prefill"], "slo_factor": "x"}}, "slo_factor"),
                      ({**good, "prefill": {**good["prefill"], "history": [[1.0]]}}, "history"),
                      ({**good, "load": [[0.0, None]]}, "load"),
                      ([], "not an object")):
        with pytest.raises(ValueError, match=what):
            ControllerState.from_json(bad)
