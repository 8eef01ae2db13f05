"""The discrete-event simulation of one splitserve cluster: requests arrive, the router's real policy object
picks a decode and a prefill worker (this module is its `WorkerView`), the decode worker reserves KV for the
prompt or prefills a short one locally (as decode_worker/service.py: a long prompt that finds no KV room waits
for it, up to `reserve_wait_s`, then goes back to the gateway as busy, which offers it to another decode worker,
or to this one after BUSY_PAUSE_S, until `queue_timeout_s`), the prefill worker computes the prompt and streams its KV
(landing after max(prefill end + tail, prefill start + bytes / bandwidth)), the decode worker decodes; every
control interval a scaling law sees an `Observation` and its decision is actuated: with `flips`, workers move
between the roles first (a flipping worker takes no new work, drains what it holds, and serves the other role
`flip_s` later), then new workers load the model for the cold start (using their GPUs meanwhile) and removed
ones drain (or are killed, for laws that do).

Events are (time, seq, kind, payload, version); arrivals stream from the sorted request list. Deterministic:
no randomness after the requests are made, ties broken by insertion order.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

from splitserve.autoscaler.bounds import Bounds, clamp
from splitserve.autoscaler.flips import flips_between
from splitserve.autoscaler.observations import Observation
from splitserve.autoscaler.profile import ReplicaProfile
from splitserve.autoscaler.sim.laws import FlipPlanner, ScalingLaw
from splitserve.autoscaler.sim.metrics import Window
from splitserve.autoscaler.sim.trace import PromptTokens, SimRequest, Status
from splitserve.autoscaler.sim.worker import SimWorker, WorkerState
from splitserve.common.config import SpillSpec
from splitserve.router.policy import BUSY_PAUSE_S, Charge, RequestFeatures, WorkerLoad, make_policy

STEP_END, LAND, READY, TICK, DRAIN_DEADLINE, FLIP_DONE, ROOM, ROOM_DEADLINE, REROUTE = range(9)


@dataclass(frozen=True)
class SimSettings:
    profile: ReplicaProfile
    prefill_profile: ReplicaProfile | None = None  # prefill workers' own, if they differ (default: `profile`)
    ttft_s: float = 2.0  # objectives: what attainment counts
    itl_s: float = 0.1
    disagg_threshold: int = 512  # prompts shorter than this are prefilled by the decode worker
    spill_prefill_tokens: int = SpillSpec().prefill_backlog_tokens  # router.spill (0: never)
    spill_local_tokens: int = SpillSpec().local_backlog_tokens
    spill_local_share: float = SpillSpec().local_share
    spill_handover_tokens: int = SpillSpec().handover_tokens
    routing: str = "least_loaded"  # router.policy
    block_size: int = 16
    gpus_per_replica: int = 1  # tensorParallelSize
    cold_start_s: float | None = None  # s a new worker loads before it serves (default: the profile's, for `engine`)
    engine: str = "native"  # whose cold start the profile gives
    flips: bool = False  # workers can move between the roles (the law's flips; else `flips_between` its targets)
    flip_s: float | None = None  # s a drained worker takes to serve the other role (default: the profile's)
    drain_seconds: float = 120.0  # a draining worker is stopped after this, failing what is left
    reserve_wait_s: float = 1.0  # decode.reserveWaitSeconds: a remote prefill waits this long for KV room
    queue_timeout_s: float = 300.0  # router.queueTimeoutSeconds: a request bounced as busy fails after this
    prefix_cache: bool = True  # workers keep the hash-id blocks of prompts they computed or received
    rpc_s: float = 0.0  # s added to every first token (gateway + gRPC), from calibration
    join_quantum_s: float = 0.0  # s: requests join a running decode batch at most this late (0: next step)
    max_time_s: float = math.inf  # stop here; requests not done count as failed
    bounds: Bounds | None = None  # hard bounds every law's wish is clamped into (as the operator does)

    @property
    def load_s(self) -> float:
        return self.profile.cold_start(self.engine) if self.cold_start_s is None else self.cold_start_s

    @property
    def switch_s(self) -> float:
        return self.profile.flip_seconds if self.flip_s is None else self.flip_s

    def feasible(self, req: SimRequest) -> bool:
        """Could an idle cluster give this request its first token within the TTFT objective? (Prompts whose
        prefill alone takes longer miss it whatever the replica count.)"""
        p = self.profile
        return p.prefill_seconds(req.prompt) + p.kv_transfer_tail_s + self.rpc_s <= self.ttft_s


@dataclass
class TimelinePoint:
    time: float
    prefill: dict[str, int]  # ready, starting, draining, desired
    decode: dict[str, int]
    gpus: int  # GPUs held (every worker not gone)
    reason: str


@dataclass
class SimResult:
    requests: list[SimRequest]
    end_time: float  # s, when the last request finished
    gpu_seconds: float
    timeline: list[TimelinePoint]
    observations: list[Observation]
    itl_samples: list[tuple[float, int]]  # (step s, tokens) of every decode step
    law: str
    settings: SimSettings
    events: int  # events processed (a cost measure)
    flips: int = 0  # workers that changed role

    def attainment(self, start: float = -math.inf, end: float = math.inf, feasible_only: bool = False) -> float:
        """Fraction of requests arriving in [start, end) that met both objectives (of those an idle cluster
        could serve in time, with `feasible_only`)."""
        s = self.settings
        chosen = [r for r in self.requests if start <= r.arrival < end and (not feasible_only or s.feasible(r))]
        if not chosen:
            return 1.0
        return sum(r.meets(s.ttft_s, s.itl_s) for r in chosen) / len(chosen)


class Simulation:
    def __init__(self, requests: list[SimRequest], settings: SimSettings, law: ScalingLaw,
                 initial: tuple[int, int]) -> None:
        self.requests = requests
        self.s = settings
        self.law = law
        # the gateway's call (router/gateway.py); no KV index here, so kv_aware routes by load
        self.policy = make_policy(settings.routing, source=None, block_size=settings.block_size,
                                  threshold=settings.disagg_threshold, spill_prefill_tokens=settings.spill_prefill_tokens,
                                  spill_local_tokens=settings.spill_local_tokens,
                                  spill_local_share=settings.spill_local_share,
                                  spill_handover_tokens=settings.spill_handover_tokens)
        self.workers: list[SimWorker] = []  # every worker ever started
        self.live: dict[str, list[SimWorker]] = {"prefill": [], "decode": []}
        self.by_name: dict[str, SimWorker] = {}
        self.window = Window()
        self.timeline: list[TimelinePoint] = []
        self.observations: list[Observation] = []
        self._events: list[tuple[float, int, int, Any, int]] = []
        self._seq = 0
        self._done = 0
        self._count = 0
        self._charges: dict[int, Charge] = {}  # rid -> its share of the named workers' load (as the gateway's)
        self._ready_loads: dict[str, list[WorkerLoad]] = {}  # role -> ready workers' loads (reset on any change)
        self.flips = 0  # flips completed
        for role, n in zip(("prefill", "decode"), initial, strict=True):
            for _ in range(n):
                self._start_worker(role, 0.0, ready=True)

    # -- WorkerView (the router's policy reads this) -------------------------------------------------------
    def candidates(self, role: str) -> list[WorkerLoad]:
        ready = self._ready_loads.get(role)
        if ready is None:
            ready = self._ready_loads[role] = [w.load for w in self.live[role] if w.state == WorkerState.READY]
        return ready

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        reqs, n, i = self.requests, len(self.requests), 0
        self._push(self.law.interval_s, TICK, None)
        events = self._events
        now = 0.0
        while self._done < n:
            t_arr = reqs[i].arrival if i < n else math.inf
            if events and events[0][0] < t_arr:
                now, _, kind, payload, version = heapq.heappop(events)
                if now > self.s.max_time_s:
                    break
                self._count += 1
                if kind == STEP_END:
                    self._step_end(payload, version, now)
                elif kind == LAND:
                    self._land(payload, now)
                elif kind == TICK:
                    self._tick(now)
                elif kind == READY:
                    self._ready(payload, now)
                elif kind == DRAIN_DEADLINE:
                    self._drain_deadline(payload, version, now)
                elif kind == FLIP_DONE:
                    self._flip_done(payload, version, now)
                elif kind == ROOM:
                    self._room(payload, now)
                elif kind == ROOM_DEADLINE:
                    self._room_deadline(payload, version, now)
                elif kind == REROUTE:
                    self._arrive(payload, now)
            elif i < n:
                now = t_arr
                if now > self.s.max_time_s:
                    break
                self._count += 1
                self._arrive(reqs[i], now)
                i += 1
            else:  # nothing scheduled and no arrival left: cannot happen while requests are pending
                raise RuntimeError(f"simulation stalled with {n - self._done} requests pending")
        for r in reqs:  # past max_time_s
            if not r.done:
                self._fail(r, now)
        end = max((r.finish for r in reqs), default=0.0)
        self.window.observe(max(end, now), self.live["prefill"] + self.live["decode"])  # the last samples
        for w in self.workers:
            if w.state != WorkerState.GONE:
                w.gone_at = end
        gpu_s = sum(max(0.0, w.gone_at - w.started) for w in self.workers) * self.s.gpus_per_replica
        return SimResult(reqs, end, gpu_s, self.timeline, self.observations, self.window.itl_samples,
                         self.law.name, self.s, self._count, self.flips)

    def _push(self, t: float, kind: int, payload: Any, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload, version))

    # -- requests ------------------------------------------------------------------------------------------
    def _arrive(self, req: SimRequest, now: float, exclude: frozenset[str] = frozenset()) -> None:
        features = RequestFeatures(PromptTokens(req.prompt, req.hash_ids, req.rid), self.s.block_size, "sim",
                                   max_tokens=req.output)
        decision = self.policy.route(features, self, exclude)
        if decision is None:
            if exclude:  # only the decode worker that said busy is up: the gateway offers it again after a pause
                self._push(now + BUSY_PAUSE_S, REROUTE, req)
            else:  # no ready decode worker: the gateway answers 503
                self._fail(req, now)
            return
        dec = self.by_name[decision.decode.name]
        pre = self.by_name[decision.prefill.name] if decision.prefill is not None else None
        blocks = -(-req.prompt // self.s.block_size)
        new_blocks = blocks - decision.cached_tokens // self.s.block_size
        req.decode_worker = dec
        dec.inflight.add(req)
        if req.prompt + req.output > dec.kv_capacity:  # can never fit: the worker rejects it
            self._charges[req.rid] = Charge(decision.decode, None, blocks, new_blocks)
            self._fail(req, now)
            return
        # as decode_worker/service.py: prefill remotely what this worker's cache lacks, if that is long enough;
        # such a prompt is never prefilled here for want of KV: it waits for room (behind any waiting already)
        uncached = req.prompt - dec.prefix_hit(req)
        remote = pre is not None and uncached >= self.s.disagg_threshold
        # charged to the worker that computes the prompt (as the gateway's, router/gateway.py)
        self._charges[req.rid] = Charge(decision.decode, decision.prefill if remote else None, blocks, new_blocks)
        if remote and (dec.room or not dec.reserve(req)):
            req.status, req.prefill_worker = Status.WAITING_ROOM, pre
            dec.room.append(req)
            self.window.arrival(req, remote=True)
            self._push(now + self.s.reserve_wait_s, ROOM_DEADLINE, req, req.bounces)
            dec.sync_load()
            return
        self.window.arrival(req, remote)
        if remote:
            assert pre is not None
            self._send(req, dec, pre, uncached, now)
        else:
            dec.enqueue_prompt(req, req.prompt, now)
        dec.sync_load()
        self._kick(dec, now)

    def _send(self, req: SimRequest, dec: SimWorker, pre: SimWorker, uncached: int, now: float) -> None:
        """The prompt, its KV reserved on `dec`, to the prefill worker."""
        req.remote = True
        req.transfer_tokens = uncached
        req.prefill_worker = pre
        pre.inflight.add(req)
        pre.enqueue_prompt(req, req.prompt, now)
        self._kick(pre, now)

    def _room(self, dec: SimWorker, now: float) -> None:
        """KV freed on a decode worker: the remote prefills waiting for room reserve it in order, and go out."""
        dec.room_due = False
        while dec.room and dec.state != WorkerState.GONE and dec.reserve(dec.room[0]):
            req = dec.room.popleft()
            pre = req.prefill_worker
            # its prefill worker left meanwhile: the call to it fails, and this worker prefills it (as the decode
            # worker's fallback does, decode_worker/service.py)
            if not (isinstance(pre, SimWorker) and pre.state == WorkerState.READY):
                pre = None
            self.window.prompt(req, remote=pre is not None)
            if pre is None:  # its KV is reserved already
                dec.unreserve(req)
                req.prefill_worker = None
                dec.enqueue_prompt(req, req.prompt, now)
            else:
                self._send(req, dec, pre, req.prompt - dec.prefix_hit(req), now)
        dec.sync_load()
        self._kick(dec, now)

    def _room_deadline(self, req: SimRequest, bounce: int, now: float) -> None:
        """No KV room in time: the decode worker sends the request back to the gateway as busy, which offers it to
        another decode worker (this one after BUSY_PAUSE_S) until the queue timeout, then answers 429."""
        dec = req.decode_worker
        if bounce != req.bounces or req.status != Status.WAITING_ROOM or not isinstance(dec, SimWorker):
            return
        dec.release(req)
        dec.sync_load()
        self._uncharge(req)
        req.decode_worker = req.prefill_worker = None
        req.status = Status.ARRIVING
        self._settle(dec, now)
        if req.busy_since < 0:
            req.busy_since = now
        if now - req.busy_since >= self.s.queue_timeout_s:
            self._fail(req, now)
            return
        req.bounces += 1
        self._arrive(req, now, exclude=frozenset({dec.name}))

    def _kick(self, w: SimWorker, now: float) -> None:
        """New work for `w`: start a step if idle; cut a long decode macro-step at its next boundary."""
        if w.state not in (WorkerState.READY, WorkerState.DRAINING, WorkerState.FLIPPING):
            return
        end = w.interrupt(now) if w.busy else w.start_step(now)
        if end is not None:
            self._push(end, STEP_END, w, w.version)

    def _step_end(self, w: SimWorker, version: int, now: float) -> None:
        if version != w.version or w.state == WorkerState.GONE:
            return
        out = w.end_step(now)
        prof = self.s.profile
        for req in out.prefilled:
            land = max(now + prof.kv_transfer_tail_s,
                       req.prefill_start + prof.kv_transfer_seconds(req.transfer_tokens))
            self._push(land + self.s.rpc_s, LAND, req)
        for req in out.first_tokens:
            self.window.ttfts.append(req.ttft + self.s.rpc_s)
            req.first_token += self.s.rpc_s
            self._charges[req.rid].first_token()
        for req in out.finished:
            self._finish(req, now)
        w.sync_load()
        end = w.start_step(now)
        if end is not None:
            self._push(end, STEP_END, w, w.version)
        self._settle(w, now)

    def _land(self, req: SimRequest, now: float) -> None:
        if req.done:
            return
        pre, dec = req.prefill_worker, req.decode_worker
        assert isinstance(pre, SimWorker) and isinstance(dec, SimWorker)
        pre.release(req)
        pre.sync_load()
        dec.cache_insert(req)
        self._settle(pre, now)
        req.first_token = req.last_token = now
        req.generated = 1
        self.window.ttfts.append(req.ttft)
        self._charges[req.rid].first_token()
        if req.output <= 1:
            self._finish(req, now)
            return
        dec.land(req)
        dec.sync_load()
        self._kick(dec, now)

    def _finish(self, req: SimRequest, now: float) -> None:
        self._end(req, now, Status.FINISHED)

    def _fail(self, req: SimRequest, now: float) -> None:
        if not req.done:
            self._end(req, now, Status.FAILED)

    def _end(self, req: SimRequest, now: float, status: Status) -> None:
        for w in (req.decode_worker, req.prefill_worker):
            if isinstance(w, SimWorker) and req in w.inflight:
                if status == Status.FAILED and req in w.decoding:
                    w.drop_decoding(req, now)  # only a worker being killed loses decoding requests
                w.release(req)
                w.sync_load()
                if w.room and not w.room_due:  # KV freed: the prompts waiting for room try once this event is done
                    w.room_due = True
                    self._push(now, ROOM, w)
        self._uncharge(req)
        req.status = status
        req.finish = now
        self._done += 1

    def _uncharge(self, req: SimRequest) -> None:
        """The request no longer counts in its workers' load, as the gateway sees it."""
        charge = self._charges.pop(req.rid, None)
        if charge is not None:
            charge.release()

    # -- scaling -------------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        all_live = self.live["prefill"] + self.live["decode"]
        obs = self.window.observe(now, all_live)
        self.observations.append(obs)
        p, d, reason = self.law.decide(obs)
        if self.s.bounds is not None:  # the actuator applies any provider's numbers within the bounds
            p, d, notes = clamp(p, d, self.s.bounds)
            reason += f"; clamped by {', '.join(notes)}" if notes else ""
        if self.s.flips:  # flips first, then starts and stops for the rest
            move = self._moves(p, d)
            if move is not None:
                self._flip(*move, now)
        self._apply("prefill", p, now)
        self._apply("decode", d, now)
        point = {}
        for role, want in (("prefill", p), ("decode", d)):
            ws = self.live[role]
            point[role] = {st.value: sum(w.state == st for w in ws) for st in
                           (WorkerState.READY, WorkerState.STARTING, WorkerState.DRAINING, WorkerState.FLIPPING)
                           } | {"desired": want}
        gpus = (len(self.live["prefill"]) + len(self.live["decode"])) * self.s.gpus_per_replica
        self.timeline.append(TimelinePoint(now, point["prefill"], point["decode"], gpus, reason))
        if self._done < len(self.requests):
            self._push(now + self.law.interval_s, TICK, None)

    def _serving(self, role: str) -> list[SimWorker]:
        """Workers counted in `role`: loading, serving, or flipping in from the other role."""
        return [w for w in self.live[role] if w.state in (WorkerState.STARTING, WorkerState.READY, WorkerState.FLIPPING)]

    def _moves(self, p: int, d: int) -> tuple[str, str, int] | None:
        """The flip the law planned (it counts its workers in `p`, `d` already), or for a law that plans none
        the one `flips_between` its targets finds."""
        if isinstance(self.law, FlipPlanner):
            flip = self.law.last_flip()
            return None if flip is None else (flip.source, flip.target, flip.workers)
        return flips_between((len(self._serving("prefill")), len(self._serving("decode"))), (p, d))

    def _flip(self, source: str, target: str, k: int, now: float) -> None:
        """Move k workers from `source` to `target`, cheapest first: one flipping into `source` is called back (it
        still holds, or just left, `target`'s work); one loading is told its role before it registers; one
        draining for a scale-down flips instead of exiting; then the ready ones holding the least."""
        ws = self.live[source]
        back = [w for w in ws if w.state == WorkerState.FLIPPING]
        loading = sorted((w for w in ws if w.state == WorkerState.STARTING), key=lambda w: w.ready_at)
        draining = [w for w in ws if w.state == WorkerState.DRAINING]
        ready = sorted((w for w in ws if w.state == WorkerState.READY),
                       key=lambda w: (w.load.outstanding, len(w.inflight), w.started))
        for w in (back + loading + draining + ready)[:k]:
            ws.remove(w)
            self.live[target].append(w)
            w.flip_seq += 1
            if w.state == WorkerState.FLIPPING:  # called back: it still is a `target` worker (or just left)
                w.state, w.flip_to, w.switching = WorkerState.READY, None, False
                w.load.draining = False
            elif w.state == WorkerState.STARTING:
                w.become(target, self._profile(target))
            else:
                self._begin_flip(w, target, now)
            self._ready_loads.clear()

    def _begin_flip(self, w: SimWorker, target: str, now: float) -> None:
        w.state, w.flip_to, w.switching = WorkerState.FLIPPING, target, False
        w.load.draining = True
        self._settle(w, now)

    def _flip_done(self, w: SimWorker, seq: int, now: float) -> None:
        if seq != w.flip_seq or w.state != WorkerState.FLIPPING or w.has_work:
            return
        assert w.flip_to is not None
        w.state = WorkerState.READY
        w.become(w.flip_to, self._profile(w.flip_to))
        self.flips += 1
        self._ready_loads.clear()

    def _profile(self, role: str) -> ReplicaProfile:
        return self.s.prefill_profile if role == "prefill" and self.s.prefill_profile else self.s.profile

    def _apply(self, role: str, target: int, now: float) -> None:
        ws = self.live[role]
        serving = self._serving(role)
        n = len(serving)
        if target > n:
            for w in [w for w in ws if w.state == WorkerState.DRAINING][:target - n]:
                w.state, w.load.draining = WorkerState.READY, False  # cancel a drain: it is loaded already
                self._ready_loads.clear()
                n += 1
            for _ in range(target - n):
                self._start_worker(role, now, ready=False)
            return
        remove = n - target
        starting = sorted((w for w in serving if w.state == WorkerState.STARTING), key=lambda w: -w.started)
        flipping = [w for w in serving if w.state == WorkerState.FLIPPING]
        ready = sorted((w for w in serving if w.state == WorkerState.READY),
                       key=lambda w: (w.load.outstanding, len(w.inflight), w.started))
        for w in (starting + flipping + ready)[:remove]:
            if w.state == WorkerState.FLIPPING:  # not wanted in its new role either: it drains and exits
                ws.remove(w)
                self.live[w.role].append(w)
                w.flip_seq += 1
                w.state, w.flip_to, w.switching = WorkerState.DRAINING, None, False
                self._push(now + self.s.drain_seconds, DRAIN_DEADLINE, w, w.flip_seq)
                self._settle(w, now)
            elif w.state == WorkerState.STARTING or not w.has_work:
                self._retire(w, now)
            elif self.law.kills_on_scale_down:
                for req in w.kill(now):
                    self._fail(req, now)
                self._retire(w, now)
            else:
                w.state, w.load.draining = WorkerState.DRAINING, True
                self._ready_loads.clear()
                self._push(now + self.s.drain_seconds, DRAIN_DEADLINE, w, w.flip_seq)

    def _start_worker(self, role: str, now: float, ready: bool) -> SimWorker:
        name = f"{role}-{len(self.workers)}"
        load_s = 0.0 if ready else self.s.load_s
        prof = self._profile(role)
        w = SimWorker(name, role, prof, now, now + load_s, self.s.itl_s,
                      self.s.prefix_cache, self.s.join_quantum_s)
        self.workers.append(w)
        self.live[role].append(w)
        self.by_name[name] = w
        if ready:
            self._ready(w, now)
        else:
            self._push(now + load_s, READY, w)
        return w

    def _ready(self, w: SimWorker, now: float) -> None:
        if w.state != WorkerState.STARTING:
            return
        w.state = WorkerState.READY
        w.load.healthy = True
        self._ready_loads.clear()

    def _settle(self, w: SimWorker, now: float) -> None:
        """A draining worker with nothing left exits; a flipping one starts its switch."""
        if w.has_work:
            return
        if w.state == WorkerState.DRAINING:
            self._retire(w, now)
        elif w.state == WorkerState.FLIPPING and not w.switching:
            w.switching = True
            self._push(now + self.s.switch_s, FLIP_DONE, w, w.flip_seq)

    def _drain_deadline(self, w: SimWorker, seq: int, now: float) -> None:
        if w.state != WorkerState.DRAINING or seq != w.flip_seq:  # not draining, or since a flip called off
            return
        for req in w.kill(now):
            self._fail(req, now)
        self._retire(w, now)

    def _retire(self, w: SimWorker, now: float) -> None:
        if w.state != WorkerState.GONE:
            w.kill(now)
        w.load.healthy = False
        self._ready_loads.clear()
        if w in self.live[w.role]:
            self.live[w.role].remove(w)


def simulate(requests: list[SimRequest], settings: SimSettings, law: ScalingLaw,
             initial: tuple[int, int]) -> SimResult:
    """Run one simulation (the requests are consumed: make fresh ones for another run)."""
    return Simulation(requests, settings, law, initial).run()


def fresh(requests: list[SimRequest]) -> list[SimRequest]:
    """Unplayed copies of requests (for another run over the same arrivals)."""
    return [SimRequest(r.rid, r.arrival, r.prompt, r.output, r.hash_ids, r.hash_block) for r in requests]
