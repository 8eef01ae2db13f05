"""The simulator's metrics: what the gateway and the workers would export over one control window, turned into
the law's `Observation` (the same dataclass a real actuator fills from Prometheus).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from splitserve.autoscaler.observations import Observation, Percentiles, RoleObservation
from splitserve.autoscaler.sim.trace import SimRequest, Status
from splitserve.autoscaler.sim.worker import SimWorker, WorkerState


@dataclass
class _RoleCounts:
    arrivals: int = 0
    input_tokens: int = 0  # prompt tokens of arrivals
    output_tokens: int = 0


@dataclass
class Window:
    """Counts since the last observation."""

    start: float = 0.0
    prefill: _RoleCounts = field(default_factory=_RoleCounts)
    decode: _RoleCounts = field(default_factory=_RoleCounts)  # local prefills count in input_tokens
    ttfts: list[float] = field(default_factory=list)
    itl_samples: list[tuple[float, int]] = field(default_factory=list)  # every window's, for the final report

    def arrival(self, req: SimRequest, remote: bool) -> None:
        """A request routed (counted once, however often a busy decode worker sends it back) and, unless it
        waits for KV room first, its prompt given to the worker that computes it."""
        if not req.counted:
            req.counted = True
            self.decode.arrivals += 1
            self.decode.output_tokens += req.output
        if req.status != Status.WAITING_ROOM:
            self.prompt(req, remote)

    def prompt(self, req: SimRequest, remote: bool) -> None:
        """A prompt given to the worker that computes it: a prefill worker (`remote`) or its decode worker."""
        if remote:
            p = self.prefill
            p.arrivals += 1
            p.input_tokens += req.prompt
        else:
            self.decode.input_tokens += req.prompt

    def observe(self, now: float, workers: Iterable[SimWorker]) -> Observation:
        span = max(1e-9, now - self.start)
        by_role: dict[str, list[SimWorker]] = {"prefill": [], "decode": []}  # by the work they hold
        flipping_in = {"prefill": 0, "decode": 0}  # flipping workers, by the role they will serve
        for w in workers:
            by_role[w.role].append(w)
            if w.state == WorkerState.FLIPPING and w.flip_to is not None:
                flipping_in[w.flip_to] += 1
        ttft = Percentiles.of(self.ttfts)
        roles = {}
        for role, ws in by_role.items():
            counts = self.prefill if role == "prefill" else self.decode
            ready = [w for w in ws if w.state == WorkerState.READY]
            samples: list[tuple[float, int]] = []
            busy, cached, admitted = 0.0, 0, 0
            waits: list[float] = []
            for w in ws:
                waits += w.queue_waits
                w.queue_waits = []
                samples += w.itl_samples
                w.itl_samples = []
                if w.state == WorkerState.READY:
                    busy += w.busy_s
                cached += w.cached_tokens
                admitted += w.admitted_tokens
                w.busy_s, w.cached_tokens, w.admitted_tokens = 0.0, 0, 0
            self.itl_samples += samples
            hit = cached / admitted if admitted else 0.0
            n = counts.arrivals
            live = [w for w in ws if w.state in (WorkerState.READY, WorkerState.DRAINING, WorkerState.FLIPPING)]
            roles[role] = RoleObservation(
                role=role, replicas_ready=len(ready),
                replicas_starting=sum(w.state == WorkerState.STARTING for w in ws),
                replicas_draining=sum(w.state == WorkerState.DRAINING for w in ws),
                replicas_flipping=flipping_in[role],
                idle_replicas=sum(not w.has_work for w in ready),
                arrival_rate=n / span,
                input_tokens_per_s=counts.input_tokens * (1 - hit) / span,
                output_tokens_per_s=counts.output_tokens / span,
                mean_input_tokens=(self.prefill.input_tokens + self.decode.input_tokens)
                / max(1, self.decode.arrivals) if role == "decode" else counts.input_tokens / max(1, n),
                mean_output_tokens=self.decode.output_tokens / max(1, self.decode.arrivals),
                num_waiting=sum(len(w.waiting) + len(w.landed) + len(w.room) for w in live),
                waiting_prefill_tokens=sum(w.pending_tokens for w in live),
                num_running=sum(len(w.prefilling) + len(w.decoding) for w in live),
                kv_usage=sum(w.kv_used / w.kv_capacity for w in ready) / len(ready) if ready else 0.0,
                busy_fraction=busy / (span * len(ready)) if ready else 0.0,
                ttft=ttft, itl=weighted_percentiles(samples), queue_wait=Percentiles.of(waits))
        self.start = now
        self.prefill, self.decode, self.ttfts = _RoleCounts(), _RoleCounts(), []
        return Observation(now, span, roles["prefill"], roles["decode"])


def weighted_percentiles(samples: list[tuple[float, int]]) -> Percentiles:
    """p50/p90/p99 of values with integer weights (step seconds, tokens in the step)."""
    total = sum(w for _, w in samples)
    if not total:
        return Percentiles()
    ordered = sorted(samples)
    out = []
    for q in (0.5, 0.9, 0.99):
        target, acc = q * total, 0
        for v, w in ordered:
            acc += w
            if acc >= target:
                out.append(v)
                break
    return Percentiles(out[0], out[1], out[2], total)
