"""Routing as a policy object: a request's features and a view of the workers in, a decision out.

A decision names the decode worker, optionally the prefill worker, and a reason (counted by the gateway in
`splitserve_router_decisions_total{policy, reason}`). Policies are plain Python with no I/O, so the autoscaler's
simulator runs the very same objects.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol

from splitserve.common.hashing import hash_token_blocks
from splitserve.router.kv_index import KVIndex, Match

# s before a decode worker that sent a request back as busy (no KV room within its wait) is offered that request
# again; other decode workers may take it at once (the gateway's rule, which the simulator follows too)
BUSY_PAUSE_S = 0.05


@dataclass
class RequestFeatures:
    """What a policy may know of a request."""

    token_ids: Sequence[int]
    block_size: int = 16
    salt: str = ""  # the served model name: block hashes are per model
    session_key: str | None = None  # from a session header or the OpenAI `user` field
    max_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    @cached_property
    def block_hashes(self) -> list[int]:
        """Chained hashes of the prompt's full blocks, as the workers' prefix caches compute them."""
        return hash_token_blocks(self.token_ids, self.block_size, self.salt)


@dataclass
class WorkerLoad:
    """One worker as a policy sees it: identity, health and load (this gateway's view plus the worker's report)."""

    name: str
    endpoint: str
    role: str  # prefill | decode | both
    healthy: bool = True
    draining: bool = False
    instance_id: str = ""  # (registry members) new at every start of the worker
    outstanding: int = 0  # requests this gateway has in flight on it
    pending_prefill_blocks: int = 0  # blocks of those requests not prefilled yet (no first token)
    decoding_blocks: int = 0  # blocks of those requests that are decoding
    peer_outstanding: int = 0  # the same three, summed over the other gateways (from their reports)
    peer_pending_prefill_blocks: int = 0
    peer_decoding_blocks: int = 0
    num_waiting: int = 0  # from the worker's last report
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_capacity_blocks: int = 0

    @property
    def total_outstanding(self) -> int:
        return self.outstanding + self.peer_outstanding

    @property
    def prefill_backlog_blocks(self) -> int:
        return self.pending_prefill_blocks + self.peer_pending_prefill_blocks

    @property
    def decode_blocks(self) -> int:
        return self.decoding_blocks + self.peer_decoding_blocks

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining

    def serves(self, role: str) -> bool:
        return self.role == role or (role == "decode" and self.role == "both")


class Charge:
    """One request's share of its workers' load while it runs, as a gateway accounts it (and the simulator, the
    same way): outstanding on both named workers; blocks waiting for their prefill on whichever worker
    computes the prompt; then, from the first token, blocks decoding on the decode worker."""

    __slots__ = ("decode", "prefill", "computing", "blocks", "new_blocks", "decoding")

    def __init__(self, decode: WorkerLoad, prefill: WorkerLoad | None, blocks: int, new_blocks: int) -> None:
        self.decode, self.prefill, self.blocks, self.new_blocks = decode, prefill, blocks, new_blocks
        self.computing = prefill or decode
        self.decoding = False
        decode.outstanding += 1
        if prefill is not None:
            prefill.outstanding += 1
        self.computing.pending_prefill_blocks += new_blocks

    def first_token(self) -> None:
        if not self.decoding:
            self.decoding = True
            self.computing.pending_prefill_blocks -= self.new_blocks
            self.decode.decoding_blocks += self.blocks

    def release(self) -> None:
        if self.decoding:
            self.decode.decoding_blocks -= self.blocks
        else:
            self.computing.pending_prefill_blocks -= self.new_blocks
        self.decode.outstanding -= 1
        if self.prefill is not None:
            self.prefill.outstanding -= 1


class WorkerView(Protocol):
    def candidates(self, role: str) -> list[WorkerLoad]:
        """Workers that can take `role`'s part of a request now (healthy, not draining)."""
        ...


@dataclass(frozen=True)
class Decision:
    decode: WorkerLoad
    prefill: WorkerLoad | None
    reason: str
    cached_tokens: int = 0  # prompt tokens the policy believes the decode worker holds already
    spilled: bool = False  # a prefill worker was due but backed up: the decode worker prefills it (`Spillover`)


class RoutingPolicy(Protocol):
    name: str
    reasons: tuple[str, ...]  # every reason it can give (counters start at 0 for each)

    def route(self, request: RequestFeatures, view: WorkerView, exclude: frozenset[str] = frozenset()) -> Decision | None:
        """The workers for `request`, never one named in `exclude`; None when no decode worker can take it."""
        ...


def _pick_prefill(view: WorkerView, key: Callable[[WorkerLoad], object]) -> WorkerLoad | None:
    prefill = view.candidates("prefill")
    return min(prefill, key=key) if prefill else None


class LeastLoaded:
    """The decode worker and the prefill worker with the fewest requests outstanding (ties: the first listed)."""

    name = "least_loaded"
    reasons = ("least_loaded",)

    def route(self, request: RequestFeatures, view: WorkerView, exclude: frozenset[str] = frozenset()) -> Decision | None:
        decode = [w for w in view.candidates("decode") if w.name not in exclude]
        if not decode:
            return None
        load = _load_key
        return Decision(min(decode, key=load), _pick_prefill(view, load), "least_loaded")


def _load_key(w: WorkerLoad) -> tuple[int, int]:
    return (w.total_outstanding, w.num_waiting + w.num_running)


class RoundRobin:
    """Decode workers in turn, prefill workers in turn, whatever their load."""

    name = "round_robin"
    reasons = ("round_robin",)

    def __init__(self) -> None:
        self._turn = itertools.count()
        self._prefill_turn = itertools.count()

    def route(self, request: RequestFeatures, view: WorkerView, exclude: frozenset[str] = frozenset()) -> Decision | None:
        decode = sorted((w for w in view.candidates("decode") if w.name not in exclude), key=lambda w: w.name)
        if not decode:
            return None
        prefill = sorted(view.candidates("prefill"), key=lambda w: w.name)
        chosen_prefill = prefill[next(self._prefill_turn) % len(prefill)] if prefill else None
        return Decision(decode[next(self._turn) % len(decode)], chosen_prefill, "round_robin")


class IndexSource(Protocol):
    """Where the kv_aware policy reads the global KV index (the gateway's ClusterState)."""

    index: KVIndex

    @property
    def usable(self) -> bool: ...

    def instances(self) -> dict[str, str]: ...


class KVAware:
    """Cache overlap against load, per worker, in blocks (docs/routing.md gives the formula and why):

        cost(w) = overlap_weight * new_blocks(w) + prefill_backlog(w) + decode_weight * decode_blocks(w)
        new_blocks(w) = prompt_blocks - gpu_match(w) - pool_credit * pool_match(w)

    The decode worker is the cheapest; if the part of the prompt it does not hold is at least `threshold`
    tokens and prefill workers exist, the cheapest prefill worker (same cost, without decode load) is named,
    otherwise the decode worker prefills locally. A session key sticks to one decode worker (rendezvous hashing,
    so every gateway replica picks the same one) unless its load exceeds the least loaded by `session_slack`
    blocks. With the index stale (Redis unreachable) overlap is ignored: routing by load only.
    """

    name = "kv_aware"
    reasons = ("kv_overlap", "load", "session", "degraded")

    def __init__(self, source: IndexSource | None, block_size: int = 16, threshold: int = 512,
                 overlap_weight: float = 4.0, decode_weight: float = 1.0, pool_credit: float = 0.8,
                 session_slack: int = 256) -> None:
        self.source = source
        self.block_size = block_size
        self.threshold = threshold
        self.overlap_weight = overlap_weight
        self.decode_weight = decode_weight
        self.pool_credit = pool_credit
        self.session_slack = session_slack

    def _matches(self, request: RequestFeatures, workers: list[WorkerLoad]) -> dict[str, Match] | None:
        src = self.source
        if src is None or not src.usable:
            return None
        live = src.instances()
        pairs = [(w.name, live.get(w.name, w.instance_id)) for w in workers]
        matches, _ = src.index.match(request.block_hashes, pairs)
        return matches

    def _new_blocks(self, nblocks: int, m: Match | None) -> float:
        if m is None:
            return float(nblocks)
        return nblocks - m.gpu - self.pool_credit * m.pool

    def route(self, request: RequestFeatures, view: WorkerView, exclude: frozenset[str] = frozenset()) -> Decision | None:
        decode = view.candidates("decode")
        if exclude:
            decode = [w for w in decode if w.name not in exclude]
        if not decode:
            return None
        prefill = view.candidates("prefill")
        nblocks = len(request.block_hashes)
        matches = self._matches(request, decode + prefill)
        degraded = matches is None and self.source is not None

        def load(w: WorkerLoad) -> float:
            return w.prefill_backlog_blocks + self.decode_weight * w.decode_blocks

        # cost(w) for every decode worker, inlined (this loop runs per request over every worker): the same
        # arithmetic as overlap_weight * _new_blocks(nblocks, m) + load(w), ties by requests in flight, then name
        overlap_weight, decode_weight, pool_credit = self.overlap_weight, self.decode_weight, self.pool_credit
        chosen, best = decode[0], None
        for w in decode:
            m = matches.get(w.name) if matches else None
            new = float(nblocks) if m is None else nblocks - m.gpu - pool_credit * m.pool
            key = (overlap_weight * new + ((w.pending_prefill_blocks + w.peer_pending_prefill_blocks)
                                           + decode_weight * (w.decoding_blocks + w.peer_decoding_blocks)),
                   w.outstanding + w.peer_outstanding, w.name)
            if best is None or key < best:
                chosen, best = w, key
        reason = "degraded" if degraded else "load"
        m = matches.get(chosen.name) if matches else None
        if m is not None and (m.gpu or m.pool):
            reason = "kv_overlap"
        if request.session_key:
            sticky = max(decode, key=lambda w: _rendezvous(request.session_key, w.name))
            if load(sticky) <= min(load(w) for w in decode) + self.session_slack:
                chosen, reason = sticky, "session"
                m = matches.get(chosen.name) if matches else None
        held = m.gpu if m is not None else 0
        uncached_tokens = request.num_prompt_tokens - held * self.block_size
        chosen_prefill = None
        if prefill and uncached_tokens >= self.threshold:
            chosen_prefill = min(prefill, key=lambda p: (
                self.overlap_weight * self._new_blocks(nblocks, matches.get(p.name) if matches else None)
                + p.prefill_backlog_blocks, p.total_outstanding, p.name))
        return Decision(chosen, chosen_prefill, reason, held * self.block_size)


class Spillover:
    """Conditional disaggregation on top of another policy: a long prompt due at a prefill worker is prefilled by its
    decode worker instead (`router.spill`) when that gives its first token no later, by the gateways' own
    accounting of both pools. With U the prompt's uncached tokens, in tokens waiting for their prefill
    (`WorkerLoad.prefill_backlog_blocks`, from every gateway replica, so replicas agree):

        local  when  prefill_backlog(p) >= prefill_backlog_tokens          (p is busy)
               and   prefill_backlog(d) + U <= local_backlog_tokens        (d's own prompts stay few)
               and   (prefill_backlog(d) + U) / local_share
                         <= prefill_backlog(p) + U + handover_tokens       (d's first token is no later)

    `local_share` is a decode worker's prefill speed beside its decodes as a share of a prefill worker's (its
    prompt chunks are capped while it decodes, `engine.maxPrefillTokensWhileDecoding`); `handover_tokens` what
    a handover adds to the first token, in prefill tokens. `local_share` 0 leaves the last test out (the first
    two alone, the backlog rule). A prefill burst then uses decode's spare compute while the autoscaler's new
    prefill replicas load, and a prompt never waits behind a long prefill queue when its decode worker would
    serve it sooner (docs/routing.md)."""

    def __init__(self, policy: RoutingPolicy, block_size: int, threshold: int, prefill_backlog_tokens: int,
                 local_backlog_tokens: int, local_share: float = 0.0, handover_tokens: int = 0) -> None:
        self.policy = policy
        self.name, self.reasons = policy.name, policy.reasons
        self.block_size, self.threshold = block_size, threshold
        self.prefill_backlog_tokens, self.local_backlog_tokens = prefill_backlog_tokens, local_backlog_tokens
        self.local_share, self.handover_tokens = local_share, handover_tokens

    def route(self, request: RequestFeatures, view: WorkerView, exclude: frozenset[str] = frozenset()) -> Decision | None:
        decision = self.policy.route(request, view, exclude)
        if decision is None or decision.prefill is None:
            return decision
        uncached = request.num_prompt_tokens - decision.cached_tokens
        if uncached < self.threshold:  # short: its decode worker prefills it anyway
            return decision
        return replace(decision, prefill=None, spilled=True) if self.local_pays(decision, uncached) else decision

    def local_pays(self, decision: Decision, uncached: int) -> bool:
        """Whether the decode worker's own prefill of `uncached` tokens beats the prefill worker's (see above)."""
        bs = self.block_size
        remote = decision.prefill.prefill_backlog_blocks * bs
        local = decision.decode.prefill_backlog_blocks * bs + uncached
        if remote < self.prefill_backlog_tokens or local > self.local_backlog_tokens:
            return False
        return self.local_share <= 0 or local <= self.local_share * (remote + uncached + self.handover_tokens)


def _rendezvous(key: str, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{worker}".encode(), digest_size=8).digest(), "little")


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    "least_loaded": LeastLoaded,
    "round_robin": RoundRobin,
    "kv_aware": KVAware,
}


class PolicyError(ValueError):
    """An unknown routing policy, or a setting that no policy takes (a misspelling): one line naming it."""


SPILL_SETTINGS = ("spill_prefill_tokens", "spill_local_tokens", "spill_local_share", "spill_handover_tokens")


def policy_settings() -> set[str]:
    """Every setting some policy takes (the spill settings apply to every policy)."""
    return {p for factory in POLICIES.values() for p in inspect.signature(factory).parameters} | set(SPILL_SETTINGS)


def _hint(word: str, valid: Collection[str]) -> str:
    close = difflib.get_close_matches(word, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def make_policy(name: str, **settings) -> RoutingPolicy:
    """The policy named in config (`router.policy`), built with its settings. A setting another policy takes is
    passed over (so one call site serves every policy); one that no policy takes is refused, as is an unknown
    name: `PolicyError`, naming it and the valid ones. A `spill_prefill_tokens` above 0 wraps the policy in
    `Spillover` (with `spill_local_tokens`, `spill_local_share`, `spill_handover_tokens`, `block_size` and
    `threshold`)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise PolicyError(f"unknown routing policy {name!r}{_hint(name, POLICIES)}; valid: {', '.join(POLICIES)}")
    known = policy_settings()
    for key in sorted(settings):
        if key not in known:
            raise PolicyError(f"unknown routing setting {key!r}{_hint(key, known)}; valid: {', '.join(sorted(known))}")
    accepted = inspect.signature(factory).parameters
    policy: RoutingPolicy = factory(**{k: v for k, v in settings.items() if k in accepted})
    spill = settings.get("spill_prefill_tokens", 0)
    if spill > 0:
        policy = Spillover(policy, settings.get("block_size", 16), settings.get("threshold", 512), spill,
                           settings.get("spill_local_tokens", 0), settings.get("spill_local_share", 0.0),
                           settings.get("spill_handover_tokens", 0))
    return policy
