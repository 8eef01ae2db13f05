"""Routing policies as plain objects, on hand-made worker views (tests/e2e/test_routing_gateway.py runs them
through a real gateway)."""

from __future__ import annotations

import pytest

from splitserve.router.policy import (
    LeastLoaded,
    RequestFeatures,
    RoundRobin,
    Spillover,
    WorkerLoad,
    make_policy,
)


class View:
    def __init__(self, *workers: WorkerLoad) -> None:
        self.workers = list(workers)

    def candidates(self, role: str) -> list[WorkerLoad]:
        return [w for w in self.workers if w.serves(role) and w.available]


def w(name: str, role: str = "decode", **kw) -> WorkerLoad:
    return WorkerLoad(name, f"{name}:1", role, **kw)


REQ = RequestFeatures([1, 2, 3])


def test_least_loaded_picks_fewest_outstanding_and_skips_unavailable():
    view = View(w("a", outstanding=3), w("b", outstanding=1), w("c", outstanding=0, healthy=False),
                w("d", outstanding=0, draining=True), w("p1", "prefill", outstanding=2), w("p2", "prefill"))
    d = LeastLoaded().route(REQ, view)
    assert (d.decode.name, d.prefill.name, d.reason) == ("b", "p2", "least_loaded")
    assert LeastLoaded().route(REQ, view, frozenset({"b"})).decode.name == "a"
    assert LeastLoaded().route(REQ, View(w("a", healthy=False))) is None


def test_round_robin_takes_turns_whatever_the_load():
    view = View(w("b", outstanding=9), w("a"), w("both", "both"))
    rr = RoundRobin()
    picks = [rr.route(REQ, view).decode.name for _ in range(6)]
    assert picks == ["a", "b", "both"] * 2
    assert rr.route(REQ, view).prefill is None  # no prefill workers: the decode worker prefills itself


def test_block_hashes_match_the_engine():
    from splitserve.common.hashing import hash_token_blocks

    ids = list(range(100))
    assert RequestFeatures(ids, 16, "m").block_hashes == hash_token_blocks(ids, 16, "m")
    assert len(RequestFeatures(ids, 16, "m").block_hashes) == 6


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


# -- spilling (router.spill): a long prompt due at a backed-up prefill worker goes to its decode worker's prefill
def spill(prefill_tokens: int = 1024, local_tokens: int = 512) -> Spillover:
    return Spillover(LeastLoaded(), block_size=16, threshold=64, prefill_backlog_tokens=prefill_tokens,
                     local_backlog_tokens=local_tokens)


LONG = RequestFeatures(list(range(300)))  # 300 tokens: above the threshold, 19 blocks


def test_a_backed_up_prefill_worker_sends_a_long_prompt_to_its_decode_worker():
    view = View(w("d"), w("p", "prefill", pending_prefill_blocks=64))
    d = spill().route(LONG, view)
    assert d.prefill is None and d.spilled and d.decode.name == "d" and d.reason == "least_loaded"
    # the other gateways' backlog counts too
    view = View(w("d"), w("p", "prefill", pending_prefill_blocks=30, peer_pending_prefill_blocks=34))
    assert spill().route(LONG, view).spilled


def test_no_spill_below_either_backlog_or_for_short_prompts():
    busy = w("p", "prefill", pending_prefill_blocks=64)
    # the prefill worker is not backed up enough
    d = spill().route(LONG, View(w("d"), w("p", "prefill", pending_prefill_blocks=63)))
    assert d.prefill is not None and d.prefill.name == "p" and not d.spilled
    # the decode worker has its own prompts to prefill: 14 blocks + 300 tokens > 512
    d = spill().route(LONG, View(w("d", pending_prefill_blocks=14), busy))
    assert d.prefill is busy and not d.spilled
    # ... 13 blocks + 300 tokens fit
    assert spill().route(LONG, View(w("d", pending_prefill_blocks=13), busy)).spilled
    # a short prompt is left as the policy had it (the decode worker prefills it anyway)
    d = spill().route(RequestFeatures(list(range(40))), View(w("d"), busy))
    assert d.prefill is busy and not d.spilled
    # no decode worker: nothing to spill to
    assert spill().route(LONG, View(busy)) is None


def test_make_policy_wraps_only_when_spill_is_on():
    assert isinstance(make_policy("least_loaded", spill_prefill_tokens=4096, spill_local_tokens=2048), Spillover)
    wrapped = make_policy("kv_aware", source=None, spill_prefill_tokens=1, threshold=32)
    assert isinstance(wrapped, Spillover) and wrapped.name == "kv_aware" and wrapped.threshold == 32
    assert isinstance(make_policy("round_robin", spill_prefill_tokens=0), RoundRobin)
    with pytest.raises(ValueError, match="unknown routing setting 'spill_prefil_tokens'"):
        make_policy("least_loaded", spill_prefil_tokens=1)


def test_a_long_prompt_goes_local_only_when_its_first_token_comes_no_later_there():
    """Conditional disaggregation: beside both backlogs' bounds, local when (local backlog + U) / share is at most
    remote backlog + U + handover."""
    conditional = Spillover(LeastLoaded(), block_size=16, threshold=64, prefill_backlog_tokens=1024,
                            local_backlog_tokens=4096, local_share=0.5, handover_tokens=200)
    busy = w("p", "prefill", pending_prefill_blocks=64)  # 1024 tokens waiting: busy enough to consider
    # an idle decode worker: (0 + 300) / 0.5 = 600 <= 1024 + 300 + 200
    assert conditional.route(LONG, View(w("d"), busy)).spilled
    # the decode worker's own 32 blocks: (512 + 300) / 0.5 = 1624 > 1524: the prefill worker is sooner
    d = conditional.route(LONG, View(w("d", pending_prefill_blocks=32), busy))
    assert d.prefill is busy and not d.spilled
    # ... unless the prefill worker is further behind: 1024 + 200 more tokens waiting there
    behind = w("p", "prefill", pending_prefill_blocks=64, peer_pending_prefill_blocks=7)
    assert conditional.route(LONG, View(w("d", pending_prefill_blocks=32), behind)).spilled
    # share 0: the backlog rule alone (the same decode worker spills)
    legacy = Spillover(LeastLoaded(), block_size=16, threshold=64, prefill_backlog_tokens=1024,
                       local_backlog_tokens=4096)
    assert legacy.route(LONG, View(w("d", pending_prefill_blocks=32), busy)).spilled
    made = make_policy("least_loaded", spill_prefill_tokens=1024, spill_local_tokens=4096, spill_local_share=0.5,
                       spill_handover_tokens=200, threshold=64)
    assert (made.local_share, made.handover_tokens) == (0.5, 200)
