"""The layer-wise push connector's scheduler side, in plain Python: which requests are ours, what a decode
server's reservation holds, and what each engine step hands the worker side. No vLLM and no torch:
`layerwise_connector` wraps it inside vLLM's scheduler process, and the tests drive it with hand-made requests.

A decode server's request arrives with `consumer` params (the worker beside it started it first, so its blocks
are reserved while the prompt is computed elsewhere): the planner tells vLLM every prompt token beyond the local
prefix hit arrives asynchronously, which parks the request in `WAITING_FOR_REMOTE_KVS` with its blocks allocated;
once vLLM allocated them the planner publishes them (`reserved`, for the worker beside vLLM to put in a ticket)
and hands the worker side the reservation. A prefill server's request arrives with `producer` params: the
planner hands the worker side, each step, which of its tokens the step computes and the request's blocks, and
keeps the blocks after the request finished until the worker side says the transfer is over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.vllm_engine.in_vllm.layerwise_wire import WireError, now, parse_request_params

Publish = Callable[..., None]  # (kind, **fields): a control message to the worker beside vLLM


@dataclass(frozen=True)
class ReservationPlan:
    """A decode reservation, for the worker side: its blocks from the first one the prompt's KV lands in."""

    req_id: str
    key: str
    block_ids: tuple[int, ...]
    deadline: float  # unix seconds


@dataclass(frozen=True)
class ProducerPlan:
    """What one engine step computes of a prefill request whose KV goes elsewhere: tokens [start, end) of its
    `num_prompt` prompt tokens, into its blocks `block_ids` (all of them, in order)."""

    req_id: str
    key: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    num_prompt: int


@dataclass
class LayerwiseStepPlan:
    reservations: list[ReservationPlan] = field(default_factory=list)
    producers: list[ProducerPlan] = field(default_factory=list)
    idle: bool = False  # the step runs no forward (vLLM steps like this while requests wait for transfers)


@dataclass
class _Producer:
    key: str
    num_prompt: int
    block_ids: list[int] = field(default_factory=list)
    scheduled: bool = False


@dataclass
class _Consumer:
    key: str
    deadline: float
    reserved: bool = False


class LayerwisePlanner:
    """The scheduler side's state, fed by the connector's calls (see the module's docstring)."""

    def __init__(self, block_size: int, engine: str, dp_rank: int, tp_size: int, publish: Publish) -> None:
        self.block_size = block_size
        self.engine = engine
        self.dp_rank = dp_rank
        self.tp_size = tp_size
        self.publish = publish
        self._consumers: dict[str, _Consumer] = {}
        self._producers: dict[str, _Producer] = {}
        self._new_reservations: list[ReservationPlan] = []

    @staticmethod
    def ours(params: Any) -> tuple[str, str, float] | None:
        """(role, key, deadline) of a request that is ours; a malformed part is not ours (vLLM runs it plainly)."""
        try:
            return parse_request_params(params)
        except WireError:
            return None

    def lookup(self, req_id: str, params: Any, num_prompt: int, num_computed: int) -> tuple[int, bool]:
        """vLLM's `get_num_new_matched_tokens`: a consumer not yet reserved gets every prompt token beyond its
        local hit asynchronously (at least the last, which vLLM recomputes to sample the first token)."""
        ours = self.ours(params)
        if ours is None or ours[0] != "consumer" or ours[2] <= now():  # past its deadline: computed here
            return 0, False
        consumer = self._consumers.get(req_id)
        if consumer is not None and consumer.reserved:  # resumed after a preemption: computed locally
            return 0, False
        self._consumers.setdefault(req_id, _Consumer(ours[1], ours[2]))
        return max(0, num_prompt - num_computed), num_prompt > num_computed

    def allocated(self, req_id: str, params: Any, block_ids: Sequence[int], num_external: int, num_prompt: int) -> None:
        """vLLM's `update_state_after_alloc`: a consumer's blocks are there (publish them); a producer starts."""
        ours = self.ours(params)
        if ours is None:
            return
        role, key, deadline = ours
        if role == "producer":
            if req_id not in self._producers:
                self._producers[req_id] = _Producer(key, num_prompt)
            return
        consumer = self._consumers.get(req_id)
        if consumer is None or consumer.reserved:
            return
        consumer.reserved = True
        if num_external <= 0:  # vLLM took it from its own cache after all: nothing lands, the request runs
            self.publish("reserved", key=key, engine=self.engine, dp=self.dp_rank, tp=self.tp_size,
                         first_block=0, block_ids=[], num_tokens=0)
            return
        first_block = (num_prompt - num_external) // self.block_size
        last_block = -(-num_prompt // self.block_size)
        blocks = [int(b) for b in block_ids[first_block:last_block]]
        self._new_reservations.append(ReservationPlan(req_id, key, tuple(blocks), deadline))
        self.publish("reserved", key=key, engine=self.engine, dp=self.dp_rank, tp=self.tp_size,
                     first_block=first_block, block_ids=blocks, num_tokens=num_prompt)

    def step(self, new: Sequence[tuple[str, int, int, Sequence[int]]],
             cached: Sequence[tuple[str, int, int, Sequence[int] | None, bool]], idle: bool = False) -> LayerwiseStepPlan:
        """One engine step: `new` as (req_id, computed, scheduled, block ids), `cached` as (req_id, computed,
        scheduled, new block ids or None, resumed: the ids replace the old); `idle`: it schedules no token."""
        plan = LayerwiseStepPlan(reservations=self._new_reservations, idle=idle)
        self._new_reservations = []
        for req_id, computed, scheduled, block_ids in new:
            p = self._producers.get(req_id)
            if p is not None:
                p.block_ids = [int(b) for b in block_ids]
                self._add(plan, req_id, p, computed, scheduled)
        for req_id, computed, scheduled, new_ids, resumed in cached:
            p = self._producers.get(req_id)
            if p is None:
                continue
            if resumed:
                p.block_ids = []
            p.block_ids.extend(int(b) for b in new_ids or ())
            self._add(plan, req_id, p, computed, scheduled)
        return plan

    @staticmethod
    def _add(plan: LayerwiseStepPlan, req_id: str, p: _Producer, computed: int, scheduled: int) -> None:
        end = min(computed + scheduled, p.num_prompt)
        if scheduled <= 0 or computed >= p.num_prompt:  # decoding past the prompt: nothing of it is sent
            return
        p.scheduled = True
        plan.producers.append(ProducerPlan(req_id, p.key, tuple(p.block_ids), computed, end, p.num_prompt))

    def finished(self, req_id: str) -> bool:
        """vLLM's `request_finished`: whether its blocks stay until the worker side reports the transfer over (a
        producer that ran); a consumer's are held by vLLM itself while it waits for its KV."""
        self._consumers.pop(req_id, None)
        p = self._producers.pop(req_id, None)
        return p is not None and p.scheduled

    @property
    def num_tracked(self) -> int:
        return len(self._consumers) + len(self._producers)
