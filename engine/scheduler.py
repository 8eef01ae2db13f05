"""Continuous-batching scheduler. Plain Python: no torch.

Progress is counters: each step gives every request `num_tokens - num_computed_tokens` more tokens under
one token budget, so chunked prefill, prefix hits, imported (remote) KV and decode are the same arithmetic.
Running decodes go first, then running prompts' next chunks; then waiting ones are admitted while blocks,
budget and seats last (`_StepBudget`: while a step carries decodes, its prompt tokens are capped, so a long
prompt never stalls the streams decoding beside it). When blocks run out, the lowest-priority running request
is preempted by recompute (its blocks freed, its counters reset; its generated tokens are kept and recomputed
as part of its prompt).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from splitserve.common.worker_messages import RequestIdInUse
from splitserve.engine.block_pool import BlockPool, KVCacheEvent
from splitserve.engine.config import CacheConfig, SchedulerConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.request import PENDING_TOKEN, Logprob, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at `start`
    start: int  # num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    logprob: Logprob | None = None


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        salt: str = "",
        on_kv_event: Callable[[KVCacheEvent], None] | None = None,
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, cache_config.enable_prefix_caching, on_kv_event)
        self.kv = KVCacheManager(self.pool, self.block_size, salt)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.held: dict[str, Request] = {}  # finished, blocks kept until release()
        self.num_preemptions = 0
        if max_model_len > num_blocks * self.block_size:
            raise ValueError(
                f"kv_cache_memory holds {num_blocks * self.block_size} tokens, fewer than "
                f"max_model_len={max_model_len}: raise kv_cache_memory or lower max_model_len"
            )

    # -- intake -------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check_new(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestIdInUse(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length is {self.max_model_len}"
            )

    def reserve_remote(self, request: Request) -> tuple[list[int], int] | None:
        """Decode role: hold blocks for a prompt whose KV will arrive from outside.

        Returns (block ids, number of prompt tokens already held locally by the prefix cache), or None
        when there is no room now. Room means a block to spare for each running request beside the prompt's:
        a reservation never takes the blocks the streams decoding here are about to grow into (which would
        preempt them, and recompute their whole context here).
        """
        self._check_new(request)
        hits, num_cached = self.kv.get_computed_blocks(request)
        need = request.num_prompt_tokens - num_cached
        if self.kv.allocate_slots(request, need, hits, keep_free=len(self.running)) is None:
            self.kv.reset_hashes(request.request_id)
            return None
        request.num_cached_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote_waiting[request.request_id] = request
        return list(self.kv.get_block_ids(request.request_id)), num_cached

    def admit_remote(self, request_id: str, first_token: SampledToken) -> Request:
        """Decode role: the prompt's KV has landed; decoding starts from `first_token`."""
        request = self.remote_waiting.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_blocks(request)
        request.status = RequestStatus.WAITING
        self._append_token(request, first_token)
        if not request.is_finished:
            self.waiting.appendleft(request)
        return request

    def admit_loaded(self, request_id: str, num_tokens: int) -> Request:
        """The first `num_tokens` prompt tokens' KV was written into the reserved blocks from outside (the KV
        pool); the request joins the queue to compute the rest. At least one prompt token is always left."""
        request = self.remote_waiting[request_id]
        if num_tokens % self.block_size or not request.num_cached_tokens <= num_tokens < request.num_prompt_tokens:
            raise ValueError(f"cannot admit {num_tokens} loaded tokens of a {request.num_prompt_tokens}-token prompt")
        del self.remote_waiting[request_id]
        request.num_loaded_tokens = num_tokens - request.num_cached_tokens
        request.num_computed_tokens = num_tokens
        self.kv.cache_blocks(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return request

    # -- the step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decodes first, then prompt chunks in what is left (vLLM's chunked prefill): a decode is never starved
        by a long prompt, and while any request decodes the step's prompt tokens stay within
        `max_prefill_tokens_while_decoding`, which bounds the step's time, each stream's inter-token latency."""
        out = SchedulerOutput()
        budget = _StepBudget(self.config, decoding=self._any_decoding())
        scheduled_ids: set[str] = set()
        running = self._by_priority(list(self.running))
        # First, the running requests' decodes (one token each), and the waiting ones whose prompt KV is all here
        # (a remote prefill's); then the running prompts' next chunks; then new prompts.
        self._schedule_running([r for r in running if self._remaining(r) <= 1], out, budget, scheduled_ids)
        if not out.preempted_req_ids:
            self._admit_waiting_decodes(out, budget)
        self._schedule_running([r for r in running if self._remaining(r) > 1], out, budget, scheduled_ids)
        if not out.preempted_req_ids:
            self._admit_waiting(out, budget)
        return out

    @staticmethod
    def _remaining(request: Request) -> int:
        """Tokens the request has to compute before its next sample: 1 for a decode, more for a prompt."""
        return request.num_tokens - request.num_computed_tokens

    def _any_decoding(self) -> bool:
        """Whether this step carries a decode: a running request one token from its next sample, or a waiting one
        whose prompt KV is all here (a remote prefill's, admitted at the head of the queue)."""
        return any(self._remaining(r) <= 1 for r in self.running) or \
            any(self._remaining(r) <= 1 for r in self.waiting)

    def _schedule_running(self, requests: list[Request], out: SchedulerOutput, budget: _StepBudget,
                          scheduled_ids: set[str]) -> None:
        for request in requests:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if request.num_pending and self._reaches_length(request):
                continue  # its token in flight is its last one
            n = budget.grant(self._remaining(request))
            if n <= 0:
                continue  # a prompt chunk with no prompt budget left (a decode is always granted its token)
            while self.kv.allocate_slots(request, n) is None:
                victim = self._pick_victim(exclude=scheduled_ids)
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, n))
                scheduled_ids.add(request.request_id)
                budget.take(n)

    def _admit_waiting_decodes(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        """Waiting requests with one token to compute (their prompt's KV landed from a prefill worker) join
        the step ahead of any prompt, wherever they are in the queue: they need a seat, not prefill time."""
        ready = [r for r in self.waiting if self._remaining(r) <= 1]
        for request in ready:
            if budget.tokens <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if self.kv.allocate_slots(request, 1) is None:
                return
            self.waiting.remove(request)
            request.num_cached_tokens = max(0, request.num_cached_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, 1))
            budget.take(1)

    def _admit_waiting(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        if self.config.policy == "priority" and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time)))
        while self.waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits: list[int] = []
            num_cached = 0
            if request.num_computed_tokens == 0:
                hits, num_cached = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - request.num_computed_tokens - num_cached
            n = budget.grant(remaining)
            if n <= 0:
                break
            if not self.config.enable_chunked_prefill and n < remaining:
                if out.scheduled or remaining <= self.config.max_num_batched_tokens:
                    break  # it waits to go whole (a prompt over the whole budget goes in chunks anyway)
            if self.kv.allocate_slots(request, n, hits) is None:
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, n))
            budget.take(n)

    def _scheduled(self, request: Request, n: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request=request,
            num_new_tokens=n,
            start=start,
            block_ids=self.kv.get_block_ids(request.request_id),
            sample=start + n == request.num_tokens,
        )

    def _by_priority(self, requests: list[Request]) -> list[Request]:
        if self.config.policy == "priority":
            return sorted(requests, key=lambda r: (r.priority, r.arrival_time))
        return requests

    def _pick_victim(self, exclude: set[str]) -> Request:
        # The request being scheduled is always a candidate, so this is never empty.
        candidates = [r for r in self.running if r.request_id not in exclude]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self._drop_pending(request)  # a token in flight for it is discarded: recompute samples it again
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        request.status = RequestStatus.WAITING

    # -- after the model ran ------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, SampledToken]
    ) -> list[tuple[Request, list[SampledToken]]]:
        """Advance counters, append sampled tokens, finish what stopped. Returns (request, new tokens)."""
        results = []
        for s in out.scheduled:
            request = s.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(request)
            if s.sample:
                token = sampled[request.request_id]
                self._append_token(request, token)
                results.append((request, [token]))
        return results

    # -- the overlapped decode step (tokens sampled on the device, read one step later) ------------------
    def launch(self, out: SchedulerOutput) -> None:
        """The decodes in `out` were launched with their tokens left on the device: advance their counters and
        hold a PENDING_TOKEN in each one's output until `commit_token`."""
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            request.output_token_ids.append(PENDING_TOKEN)
            request.num_pending += 1

    def commit_token(self, request: Request, token: SampledToken) -> None:
        """The oldest pending token of `request` is `token`: check stops and cache blocks as `update_from_output`
        does. A stop discards the tokens launched after it."""
        ids = request.output_token_ids
        i = len(ids) - request.num_pending
        ids[i] = token.token_id
        later = request.num_pending = request.num_pending - 1
        self._drop_pending(request)  # the stop check counts real tokens only
        self.kv.cache_blocks(request)
        status = self._check_stop(request, token.token_id)
        if status is not None:
            self.finish_request(request.request_id, status)
        elif later:
            ids.extend([PENDING_TOKEN] * later)
            request.num_pending = later
            request.num_computed_tokens += later

    def _drop_pending(self, request: Request) -> None:
        if request.num_pending:
            del request.output_token_ids[-request.num_pending:]
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            request.num_pending = 0

    def _reaches_length(self, request: Request) -> bool:
        return (request.num_output_tokens >= request.sampling_params.max_tokens
                or request.num_tokens >= self.max_model_len)

    def _append_token(self, request: Request, token: SampledToken) -> None:
        request.output_token_ids.append(token.token_id)
        if token.logprob is not None:
            request.output_logprobs.append(token.logprob)
        status = self._check_stop(request, token.token_id)
        if status is not None:
            self.finish_request(request.request_id, status)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        sp = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in sp.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if n_out >= sp.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- endings ------------------------------------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is; its blocks are freed at once unless held."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.is_finished:
            if request_id in self.held and status == RequestStatus.FINISHED_ABORTED:
                self.release(request_id)
            return request
        self._drop_pending(request)
        if request in self.running:
            self.running.remove(request)
        elif request_id in self.remote_waiting:
            del self.remote_waiting[request_id]
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        if request.hold_blocks and status != RequestStatus.FINISHED_ABORTED:
            self.held[request_id] = request
        else:
            self.kv.free(request_id)
            del self.requests[request_id]
        return request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        for rid in list(request_ids):
            self.finish_request(rid, status)

    def release(self, request_id: str) -> bool:
        """Free the blocks of a finished request that held them (prefill role after its KV was sent)."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request_id)
        self.requests.pop(request_id, None)
        return True

    # -- introspection ------------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, int]:
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_waiting_remote_kv": len(self.remote_waiting),
            "num_held": len(self.held),
            "kv_blocks_used": self.pool.num_used_blocks,
            "kv_blocks_total": self.pool.num_blocks,
            "num_preemptions": self.num_preemptions,
            "tokens_in_flight": sum(r.num_tokens for r in self.running),
            "waiting_prefill_tokens": sum(r.num_tokens - r.num_computed_tokens for r in self.waiting),
        }


class _StepBudget:
    """One step's token budget: `max_num_batched_tokens` in all; a prompt chunk at most
    `long_prefill_token_threshold`, and the step's prompt tokens at most `max_prefill_tokens_while_decoding` while
    it carries a decode (0: no such cap). A decode (one token) needs only the step's budget."""

    def __init__(self, config: SchedulerConfig, decoding: bool) -> None:
        self.tokens = config.max_num_batched_tokens
        self.prefill = config.max_prefill_tokens_while_decoding if decoding else 0
        if self.prefill <= 0:
            self.prefill = self.tokens
        self.chunk = config.long_prefill_token_threshold or self.tokens

    def grant(self, remaining: int) -> int:
        """Tokens a request with `remaining` to compute may have now (0: none)."""
        if remaining <= 1:
            return min(remaining, self.tokens)
        return min(remaining, self.tokens, self.prefill, self.chunk)

    def take(self, n: int) -> None:
        self.tokens -= n
        if n > 1:
            self.prefill -= n
