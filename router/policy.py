"""Routing as a policy object: a request's features and a view of the workers in, a decision out.

A decision names the decode worker, optionally the prefill worker, and a reason (counted by the gateway in
`splitserve_router_decisions_total{policy, reason}`). Policies are plain Python with no I/O, so the autoscaler's
simulator runs the very same objects.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from splitserve.common.hashing import hash_token_blocks


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
    outstanding: int = 0  # requests this gateway (and, with a registry, its peers) has in flight on it
    num_waiting: int = 0  # from the worker's last stats report
    num_running: int = 0
    waiting_prefill_tokens: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    meta: dict = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining

    def serves(self, role: str) -> bool:
        return self.role == role or (role == "decode" and self.role == "both")


class WorkerView(Protocol):
    def candidates(self, role: str) -> list[WorkerLoad]:
        """Workers that can take `role`'s part of a request now (healthy, not draining)."""
        ...


@dataclass(frozen=True)
class Decision:
    decode: WorkerLoad
    prefill: WorkerLoad | None
    reason: str


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
    return (w.outstanding, w.num_waiting + w.num_running)


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


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    "least_loaded": LeastLoaded,
    "round_robin": RoundRobin,
}


def make_policy(name: str, **settings) -> RoutingPolicy:
    """The policy named in config (`router.policy`), built with its settings."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(**settings)
