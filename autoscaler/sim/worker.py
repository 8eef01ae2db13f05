"""One simulated worker: our engine's continuous batching at the step level, timed by the replica profile.

Like `engine/scheduler.py`, a step takes every decoding request (one token each) first, then prompt chunks of
running and waiting requests under the token budget, seats (`max_num_seqs`) and KV capacity; when KV runs
out, the newest decoding request is preempted and recomputed. A prefill worker holds a prompt's KV until it has
been sent; a decode worker reserves it when the request arrives (or prefills short prompts itself).

Speed: steps that only decode are simulated as one "macro-step" up to the next request that finishes (or the
KV cache fills). Its step times grow linearly with the context (dt_j = a0 + delta*j), so duration, slow-step
counts and the boundary after any instant have closed forms; a request that lands mid-macro-step cuts it at the
next step boundary (`interrupt`), or with a join quantum at the first boundary that far into the macro-step
(at GPU step rates this saves most events; a request then joins its batch at most a quantum late). Per-request ITL is counted, not listed: each worker keeps a running count of
steps slower than the ITL objective, and a request's count is the difference between its join and its end.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from splitserve.autoscaler.profile import ReplicaProfile, attn_pairs
from splitserve.autoscaler.sim.trace import SimRequest, Status
from splitserve.router.policy import WorkerLoad


class WorkerState(enum.Enum):
    STARTING = "starting"  # loading the model (uses its GPUs, serves nothing)
    READY = "ready"
    DRAINING = "draining"  # finishing its requests, takes no new ones
    FLIPPING = "flipping"  # finishing its old role's requests, takes no new ones, then serves `flip_to`
    GONE = "gone"


@dataclass
class StepOutcome:
    """What a finished step produced, for the simulation to act on."""

    prefilled: list[SimRequest]  # prefill worker: prompts done, KV to send
    first_tokens: list[SimRequest]  # decode worker: prompts it prefilled itself, first token out
    finished: list[SimRequest]  # decode worker: requests that generated their last token


class SimWorker:
    def __init__(self, name: str, role: str, profile: ReplicaProfile, now: float, ready_at: float,
                 itl_slo: float, prefix_cache: bool, join_quantum_s: float = 0.0) -> None:
        self.name, self.role, self.profile = name, role, profile
        self.cost = profile.cost
        self.load = WorkerLoad(name, name, role, healthy=False)  # what the router's policy sees
        self.state = WorkerState.STARTING
        self.started, self.ready_at, self.gone_at = now, ready_at, -1.0
        self.itl_slo = itl_slo
        self.block_size = 16  # tokens per KV block (reports count blocks)
        self.join_quantum_s = join_quantum_s  # s: a macro-step is cut no earlier than this after it began
        self.kv_capacity = profile.kv_capacity_tokens  # tokens
        self.kv_used = 0  # tokens
        self.held: dict[int, int] = {}  # prefill: request id -> KV tokens held until sent
        self.waiting: deque[SimRequest] = deque()  # prompts to compute here, not admitted yet
        self.prefilling: list[SimRequest] = []  # admitted, prompt not done
        self.landed: deque[SimRequest] = deque()  # decode: KV arrived (or prompt done here), waiting to join
        self.room: deque[SimRequest] = deque()  # decode: remote prefills waiting for KV room to reserve, in order
        self.room_due = False  # KV was freed while some wait for room: a check is scheduled
        self.decoding: list[SimRequest] = []  # in joining order (newest last: the preemption victim)
        self.inflight: set[SimRequest] = set()  # every request touching this worker (for kills)
        self.pending_tokens = 0  # prompt tokens waiting or prefilling here, not yet computed
        self._finish_heap: list[tuple[int, int, int, SimRequest]] = []  # (clock to finish, rid, stint, request)
        self.clock = 0  # decode steps done
        self.ctx_sum = 0  # KV tokens of decoding requests
        self.cum_slow = 0  # decode steps slower than the ITL objective, so far
        self.busy_s = 0.0  # s spent in steps (drained by the metrics window)
        self.admitted_tokens = 0  # prompt tokens admitted (drained likewise)
        self.queue_waits: list[float] = []  # s from enqueue to first step, per admitted prompt (drained likewise)
        self.cached_tokens = 0  # of which found in the prefix cache
        self.itl_samples: list[tuple[float, int]] = []  # (step s, tokens) of decode steps (drained likewise)
        self.version = 0  # bumps when the scheduled step end changes: older events are stale
        self.cache: OrderedDict[int, None] | None = OrderedDict() if prefix_cache else None
        self.flip_to: str | None = None  # FLIPPING: the role it serves next
        self.flip_seq = 0  # bumps on every flip started or called off: an older FLIP_DONE is stale
        self.switching = False  # FLIPPING and drained: the switch (flip_s) is under way
        self._step: _Step | None = None

    # -- state ---------------------------------------------------------------------------------------------
    def become(self, role: str, profile: ReplicaProfile) -> None:
        """Serve `role` from now (a flip's end; the worker holds no request). Its prefix cache stays."""
        assert not self.inflight
        self.role, self.profile, self.cost = role, profile, profile.cost
        self.held.clear()
        self.load = WorkerLoad(self.name, self.name, role, healthy=self.state == WorkerState.READY)
        self.flip_to, self.switching = None, False

    @property
    def busy(self) -> bool:
        return self._step is not None

    @property
    def has_work(self) -> bool:
        return bool(self.inflight)

    def sync_load(self) -> None:
        """Refresh the policy's view (workers report these in their stats)."""
        ld = self.load
        ld.num_waiting = len(self.waiting) + len(self.landed) + len(self.room)
        ld.num_running = len(self.prefilling) + len(self.decoding)
        bs = self.block_size
        ld.kv_blocks_used, ld.kv_capacity_blocks = -(-self.kv_used // bs), self.kv_capacity // bs

    # -- intake --------------------------------------------------------------------------------------------
    def reserve(self, req: SimRequest) -> bool:
        """Decode: hold KV for a prompt a prefill worker will compute (False: no room now)."""
        if self.kv_used + req.prompt > self.kv_capacity:
            return False
        self.kv_used += req.prompt
        req.kv_held = req.prompt
        return True

    def unreserve(self, req: SimRequest) -> None:
        """Decode: give back the KV `reserve` held (the prompt is computed here after all)."""
        self.kv_used -= req.kv_held
        req.kv_held = 0

    def enqueue_prompt(self, req: SimRequest, to_compute: int, now: float, front: bool = False) -> None:
        """A prompt (or a recompute of prompt + output so far) to compute on this worker."""
        req.to_compute, req.computed, req.enqueued = to_compute, 0, now
        req.status = Status.WAITING_PREFILL if self.role == "prefill" else Status.WAITING_DECODE
        (self.waiting.appendleft if front else self.waiting.append)(req)
        self.pending_tokens += to_compute

    def land(self, req: SimRequest) -> None:
        """Decode: the request's first token and KV are here; it decodes from the next step."""
        req.status = Status.WAITING_DECODE
        self.landed.append(req)

    # -- steps ---------------------------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Compose and time the next step; its end time, or None when there is nothing to do."""
        assert self._step is None
        p = self.profile
        seats = p.max_num_seqs - len(self.decoding) - len(self.prefilling)
        joining: list[SimRequest] = []
        while self.landed and seats > 0:
            joining.append(self.landed.popleft())
            seats -= 1
        for req in joining:
            if req.remote and req.generated == 1:  # from its KV landing to its first decode step
                self.queue_waits.append(now - req.last_token)
            self._join(req)
        self._make_room(now)
        b = len(self.decoding)
        budget = p.max_num_batched_tokens - b
        chunks: list[tuple[SimRequest, int]] = []
        pairs = 0.0
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.to_compute - req.computed, budget)
            chunks.append((req, n))
            pairs += attn_pairs(n, req.computed)
            budget -= n
        while self.waiting and budget > 0 and seats > 0:
            req = self.waiting[0]
            if self.kv_used + req.to_compute > self.kv_capacity:
                break
            self.waiting.popleft()
            self._admit(req, now)
            seats -= 1
            n = min(req.to_compute - req.computed, budget)
            if n <= 0:  # all of it was in the prefix cache (the last token is always computed)
                continue
            chunks.append((req, n))
            pairs += attn_pairs(n, req.computed)
            budget -= n
        if not b and not chunks:
            return None
        c = self.cost
        if chunks:  # one mixed step
            tokens = b + sum(n for _, n in chunks)
            a0 = c.seconds(b + len(chunks), tokens, self.ctx_sum, pairs)
            k, delta = 1, 0.0
        else:  # decode only: a macro-step up to the next finish or a full KV cache
            a0 = c.decode_seconds(b, self.ctx_sum)
            delta = c.per_ctx_token_s * b  # s added per step as every context grows by one token
            k = max(1, min(self._steps_to_finish(), (self.kv_capacity - self.kv_used) // b))
        step = _Step(now, k, a0, delta, b, chunks)
        for req in joining:  # first gap: from its first token to the end of its first decode step
            if req.status != Status.DECODING:  # preempted by _make_room before it ran
                continue
            gap = now + a0 - req.last_token
            req.slow_itls += gap > self.itl_slo
            req.join_slow = self.cum_slow + (a0 > self.itl_slo)
        self._step = step
        return now + step.duration(k)

    def interrupt(self, now: float) -> float | None:
        """A request arrived: end the current macro-step at the next step boundary. The new end, or None if
        unchanged."""
        s = self._step
        if s is None or s.k == 1:
            return None
        j = s.steps_by(max(now - s.start, self.join_quantum_s))
        if j >= s.k:
            return None
        s.k = j
        self.version += 1
        return s.start + s.duration(j)

    def end_step(self, now: float) -> StepOutcome:
        s = self._step
        assert s is not None
        self._step = None
        self.busy_s += now - s.start
        out = StepOutcome([], [], [])
        if s.b:
            k = s.k
            self.cum_slow += s.slow_steps(self.itl_slo)
            self.itl_samples.append((s.a0 + s.delta * (k - 1) / 2, s.b * k))
            self.clock += k
            self.ctx_sum += s.b * k
            self.kv_used += s.b * k
            heap = self._finish_heap
            while heap and heap[0][0] <= self.clock:
                _, _, stint, req = heapq.heappop(heap)
                if stint == req.stint and req.status == Status.DECODING:
                    self._leave_decode(req, now)
                    req.finish = now
                    out.finished.append(req)
        for req, n in s.chunks:
            if req.done or req not in self.inflight:  # killed meanwhile
                continue
            req.computed += n
            self.pending_tokens -= n
            if req.computed >= req.to_compute:
                self.prefilling.remove(req)
                self.cache_insert(req)
                if self.role == "prefill":
                    req.status = Status.TRANSFERRING
                    out.prefilled.append(req)
                else:  # prefilled here: the next token is sampled now
                    if req.first_token < 0:
                        req.first_token = now
                        out.first_tokens.append(req)
                    else:
                        req.slow_itls += now - req.last_token > self.itl_slo
                    req.generated += 1
                    req.last_token = now
                    if req.generated >= req.output:
                        req.finish = now
                        out.finished.append(req)
                    else:
                        self.landed.appendleft(req)
        return out

    # -- inside a step -------------------------------------------------------------------------------------
    def prefix_hit(self, req: SimRequest) -> int:
        """Prompt tokens of `req` this worker's prefix cache holds (whole hash blocks from the start; the last
        prompt token is always computed)."""
        if self.cache is None or not req.hash_ids:
            return 0
        hits = 0
        for h in req.hash_ids:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hits += 1
        return max(0, min(hits * req.hash_block, req.prompt - 1))

    def _admit(self, req: SimRequest, now: float) -> None:
        if req.computed == 0 and req.to_compute == req.prompt:  # a fresh prompt (not a recompute)
            req.cached = self.prefix_hit(req)
            req.computed = req.cached
            self.pending_tokens -= req.cached
            self.cached_tokens += req.cached
        self.admitted_tokens += req.to_compute
        self.kv_used += req.to_compute
        if self.role == "prefill":
            self.held[req.rid] = req.to_compute
        else:
            req.kv_held = req.to_compute
        if req.prefill_start < 0:
            req.prefill_start = now
        self.queue_waits.append(now - req.enqueued)
        req.status = Status.PREFILLING if self.role == "prefill" else Status.LOCAL_PREFILLING
        self.prefilling.append(req)

    def cache_insert(self, req: SimRequest) -> None:
        """The prompt's blocks are in this worker's KV now (computed here, or received)."""
        if self.cache is None:
            return
        for h in req.hash_ids:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) * req.hash_block > self.kv_capacity:  # the cache is what the KV memory holds
            self.cache.popitem(last=False)

    def _join(self, req: SimRequest) -> None:
        length = req.prompt + req.generated  # KV tokens it will have once this step writes its last token
        self.kv_used += length - req.kv_held
        req.kv_held = length
        self.ctx_sum += length
        req.status = Status.DECODING
        req.join_clock = self.clock
        req.join_slow = self.cum_slow
        heapq.heappush(self._finish_heap, (self.clock + req.output - req.generated, req.rid, req.stint, req))
        self.decoding.append(req)

    def _steps_to_finish(self) -> int:
        heap = self._finish_heap
        while heap and (heap[0][2] != heap[0][3].stint or heap[0][3].status != Status.DECODING):
            heapq.heappop(heap)
        return heap[0][0] - self.clock if heap else 1 << 30

    def _make_room(self, now: float) -> None:
        """Preempt the newest decoding requests until the next step's tokens fit the KV cache."""
        while self.decoding and self.kv_used + len(self.decoding) > self.kv_capacity:
            req = self.decoding[-1]
            self._leave_decode(req, now)
            req.stint += 1
            req.last_token = now
            req.generated = req.kv_held - req.prompt
            self.kv_used -= req.kv_held
            req.kv_held = 0
            self.enqueue_prompt(req, req.prompt + req.generated, now, front=True)

    def _leave_decode(self, req: SimRequest, now: float) -> None:
        """Take a decoding request out of the batch, settling its counters (its KV stays until released)."""
        self.decoding.remove(req)
        steps = self.clock - req.join_clock
        req.slow_itls += self.cum_slow - req.join_slow
        req.kv_held += steps
        req.generated += steps
        req.last_token = now
        self.ctx_sum -= req.prompt + req.generated

    def drop_decoding(self, req: SimRequest, now: float) -> None:
        """A decoding request failed here (the worker was killed): out of the batch, its KV growth settled so that
        `release` frees all of it."""
        self._leave_decode(req, now)

    def release(self, req: SimRequest) -> None:
        """Free whatever this worker holds for `req` (KV, queue places) and forget it."""
        if self.role == "prefill":
            self.kv_used -= self.held.pop(req.rid, 0)
        else:
            self.kv_used -= req.kv_held
            req.kv_held = 0
        if req.status == Status.WAITING_ROOM and req in self.room:
            self.room.remove(req)
        if req.status in (Status.WAITING_PREFILL, Status.WAITING_DECODE, Status.PREFILLING, Status.LOCAL_PREFILLING):
            if req in self.waiting:
                self.waiting.remove(req)
                self.pending_tokens -= req.to_compute - req.computed
            elif req in self.prefilling:
                self.prefilling.remove(req)
                self.pending_tokens -= req.to_compute - req.computed
            elif req in self.landed:
                self.landed.remove(req)
        self.inflight.discard(req)

    def kill(self, now: float) -> list[SimRequest]:
        """Stop at once (a scale-down that does not drain): the requests in flight here."""
        victims = list(self.inflight)
        self._step = None
        self.version += 1
        self.state = WorkerState.GONE
        self.gone_at = now
        return victims


class _Step:
    """A step in flight: `k` steps of `b` decodes (dt_j = a0 + delta*j), or one mixed step with chunks."""

    __slots__ = ("start", "k", "a0", "delta", "b", "chunks")

    def __init__(self, start: float, k: int, a0: float, delta: float, b: int,
                 chunks: list[tuple[SimRequest, int]]) -> None:
        self.start, self.k, self.a0, self.delta, self.b, self.chunks = start, k, a0, delta, b, chunks

    def duration(self, j: int) -> float:
        """Seconds of the first j steps."""
        return j * self.a0 + self.delta * j * (j - 1) / 2

    def steps_by(self, elapsed: float) -> int:
        """The fewest steps (>= 1) whose end is at or after `elapsed` s from the start."""
        a, d = self.a0, self.delta
        if d <= 0:
            j = math.ceil(elapsed / a - 1e-12)
        else:
            lin = a - d / 2
            j = math.ceil((-lin + math.sqrt(lin * lin + 2 * d * elapsed)) / d - 1e-12)
        j = max(1, j)
        while self.duration(j) < elapsed - 1e-12:
            j += 1
        while j > 1 and self.duration(j - 1) >= elapsed:
            j -= 1
        return j

    def slow_steps(self, limit: float) -> int:
        """Steps among the k whose duration exceeds `limit` s (durations grow with j)."""
        if self.a0 > limit:
            return self.k
        if self.delta <= 0:
            return 0
        first = math.floor((limit - self.a0) / self.delta) + 1  # first j with a0 + delta*j > limit
        return max(0, self.k - first)
