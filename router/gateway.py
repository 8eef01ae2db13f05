"""The gateway's core, below HTTP: route a parsed request (policy + worker view), call the decode worker (its
`WorkerClient`) naming the prefill worker, and turn the token stream into text pieces.

The gateway owns detokenization and stop strings (the engine deals in token ids only): the engine's step loop
stays free of per-token text work, and gateways scale out independently of GPU workers. When a stop string
appears, the gateway ends the call, which aborts the request on the worker.

Because the gateway holds each stream's output tokens, detokenizer and usage, a stream whose decode worker fails
mid-way (dies, drops the connection, stalls, runs out of drain time) moves: the gateway routes the prompt plus
the tokens already sent again, and the chosen worker continues after them (`resume_token_ids`, only to workers
whose health lists `resume`; seeded sampling is keyed by output position, so the continuation is the one the
first worker would have sampled). The client sees one stream. Bad input and a client's cancel never move.
A decode worker with no KV room for a prompt sends it back before its first token (retry `busy`): the gateway
tries another decode worker, or that one again after a pause, until `router.queueTimeoutSeconds`, then 429.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from splitserve.common.config import ClusterSpec
from splitserve.common.membership import Membership
from splitserve.common.model_files import max_positions, resolve_model
from splitserve.common.sampling import Logprob
from splitserve.common.text import IncrementalDetokenizer, Tokenizer
from splitserve.common.worker_messages import GenerateCall, RetryReason, TokenStream, WorkerCallError
from splitserve.router import metrics as m
from splitserve.router.cluster import ClusterState
from splitserve.router.errors import APIError, bad
from splitserve.router.openai_protocol import GenerationSpec
from splitserve.router.policy import (
    BUSY_PAUSE_S,
    Charge,
    Decision,
    RequestFeatures,
    RoutingPolicy,
    make_policy,
)
from splitserve.router.workers import Worker, WorkerSet

log = logging.getLogger("splitserve.router")


@dataclass
class Piece:
    """A slice of one request's output: new text, its tokens and log-probabilities."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""  # with finish_reason error: what failed


class Gateway:
    def __init__(self, spec: ClusterSpec, membership: Membership, cluster: ClusterState | None = None) -> None:
        self.spec = spec
        model = spec.model
        model_dir = resolve_model(model.tokenizer or model.name, need_weights=False)
        self.tokenizer = Tokenizer(model_dir)
        self.max_model_len = model.max_model_len or max_positions(model_dir)
        self.max_prompt_chars = spec.router.max_prompt_chars or 32 * self.max_model_len
        self.model_name = model.served_name
        self.cluster = cluster
        self.workers = WorkerSet(membership, spec.router.health_interval_seconds, spec.router.health_failures)
        kv = spec.router.kv_aware
        self.policy: RoutingPolicy = make_policy(
            spec.router.policy, source=cluster, block_size=model.block_size, threshold=spec.decode.disagg_threshold,
            overlap_weight=kv.overlap_weight, decode_weight=kv.decode_weight, pool_credit=kv.pool_credit,
            session_slack=kv.session_slack_blocks, spill_prefill_tokens=spec.router.spill.prefill_backlog_tokens,
            spill_local_tokens=spec.router.spill.local_backlog_tokens, spill_local_share=spec.router.spill.local_share,
            spill_handover_tokens=spec.router.spill.handover_tokens)
        for reason in self.policy.reasons:
            m.DECISIONS.labels(self.policy.name, reason)
        m.PREFIX_HIT_TOKENS.inc(0)
        if cluster is not None:
            cluster.local_load_fn = self._local_load
            cluster.on_peer_load = self._fold_peer_load

    def _local_load(self) -> dict[str, tuple[int, int, int]]:
        return {w.info.name: (w.load.outstanding, w.load.pending_prefill_blocks, w.load.decoding_blocks)
                for w in self.workers.workers if w.load.outstanding}

    def _fold_peer_load(self, peers: dict[str, tuple[int, int, int]]) -> None:
        for w in self.workers.workers:
            w.load.peer_outstanding, w.load.peer_pending_prefill_blocks, w.load.peer_decoding_blocks = \
                peers.get(w.info.name, (0, 0, 0))

    def features(self, gen: GenerationSpec, context: Sequence[int] | None = None) -> RequestFeatures:
        """What the policy sees of a request; `context` (a moved request: prompt + its output so far) replaces
        the prompt, so kv_aware favours a worker that holds (or can load) the most of it."""
        return RequestFeatures(gen.prompt_token_ids if context is None else context, self.spec.model.block_size,
                               self.model_name, gen.session_key, gen.params.max_tokens)

    async def start(self) -> None:
        if self.cluster is not None:
            await self.cluster.start()
        await self.workers.start()

    async def close(self) -> None:
        await self.workers.close()
        if self.cluster is not None:
            await self.cluster.close()

    def can_serve(self) -> bool:
        return bool(self.workers.candidates("decode"))

    def check_servable(self) -> None:
        """503 only when no decode worker lives at all (slow or starting ones are waited for)."""
        if not self.workers.alive("decode"):
            raise APIError(503, "no decode worker is available", code="no_workers")

    async def _route(self, request: RequestFeatures, tried: set[str], busy_until: dict[str, float] | None = None):
        """A decision, never a worker in `tried`, nor one in `busy_until` before its time; while no decode worker is
        up but some are slow or starting (or busy), wait for one (bounded)."""
        deadline = time.monotonic() + self.spec.router.queue_timeout_seconds
        while True:
            now = time.monotonic()
            busy = {name for name, until in (busy_until or {}).items() if until > now}
            decision = self.policy.route(request, self.workers, frozenset(tried | busy))
            if decision is not None:
                return decision
            if not self.workers.alive("decode") or (tried and not self.workers.candidates("decode")
                                                    and not self._others_alive(tried)):
                raise APIError(503, "no decode worker is available", code="no_workers")
            left = deadline - now
            if left <= 0:
                raise APIError(429, "no decode worker answered in time; retry later", code="workers_busy",
                               headers={"Retry-After": "5"})
            pause = min((busy_until[name] - now for name in busy), default=1.0)
            await self.workers.wait_for_change(min(left, 1.0, pause))

    def _others_alive(self, tried: set[str]) -> bool:
        return any(w.load.serves("decode") and w.info.name not in tried and not w.load.draining and w.state != "down"
                   for w in self.workers.workers)

    async def generate(self, gen: GenerationSpec, rid: str) -> AsyncIterator[Piece]:
        """Pieces of output. A stream that fails mid-way (its worker died or dropped the connection, stalled
        past `stallSeconds`, ran out of drain time, or its engine stopped) moves to another decode worker, up
        to `migrationLimit` times: that worker continues after the tokens already sent, and the client sees one
        stream. A failure before the first token tries another worker as before (no limit: each worker once)."""
        sp = gen.params
        run = _Run(IncrementalDetokenizer(self.tokenizer, gen.prompt_token_ids, sp.stop, sp.include_stop_str_in_output),
                   len(gen.prompt_token_ids))
        while True:
            if len(run.produced) >= sp.max_tokens:  # it failed after its last token, before its end
                yield run.piece([], [], "length")
                return
            try:
                decision = await self._reroute(gen, rid, run)
                async for piece in self._attempt(gen, rid, run, decision):
                    yield piece
                return  # the attempt reached the request's finish
            except _Moved as failed:
                if failed.reason == RetryReason.BUSY and not run.produced:
                    self._bounced(run)  # raises APIError 429 once it has bounced for router.queueTimeoutSeconds
                    continue
                why = self._may_not_move(rid, run, failed)
            except APIError as e:  # it cannot go on: an error before its first token, the stream's end after it
                if not run.produced:
                    raise
                why = e.message
            if why is not None:
                yield run.error_end(why)
                return

    async def _reroute(self, gen: GenerationSpec, rid: str, run: _Run) -> Decision:
        """A decode worker the request has not tried (once it has output: one that can continue it), chosen for
        its context so far. Raises `APIError` when there is none."""
        exclude = run.tried | self._cannot_resume() if run.produced else run.tried
        try:
            decision = await self._route(self.features(gen, gen.prompt_token_ids + run.produced), exclude,
                                         run.busy_until)
        except APIError as e:
            if run.moving is not None:
                run.moving.end("no_worker")
                if run.produced:
                    log.warning("request %s: no decode worker to continue it on (%s)", rid, e.message)
            raise
        m.DECISIONS.labels(self.policy.name, decision.reason).inc()
        m.PREFIX_HIT_TOKENS.inc(decision.cached_tokens)
        if decision.spilled:
            m.SPILLS.inc()
        run.tried.add(decision.decode.name)
        run.worker = decision.decode.name
        return decision

    def _bounced(self, run: _Run) -> None:
        """The decode worker had no KV room for the prompt in time (busy): another decode worker may take it now,
        this one after BUSY_PAUSE_S. Raises `APIError` 429 once the request has bounced for the queue timeout."""
        now = time.monotonic()
        run.busy_since = run.busy_since or now
        if now - run.busy_since > self.spec.router.queue_timeout_seconds:
            raise APIError(429, "every decode worker is out of KV room; retry later", code="workers_busy",
                           headers={"Retry-After": "5"})
        m.BUSY_RETRIES.inc()
        run.bounces += 1
        run.tried.discard(run.worker)
        run.busy_until[run.worker] = now + BUSY_PAUSE_S

    async def _attempt(self, gen: GenerationSpec, rid: str, run: _Run, decision: Decision) -> AsyncIterator[Piece]:
        """One decode worker's try at the request, from where it stands, to its finish. Raises `_Moved` when
        another worker may continue it, `APIError` when it ends here (bad input, or the worker failed it)."""
        worker = self.workers.get(decision.decode.name)
        run.endpoint = worker.endpoint
        charge = self._charge(decision, run)
        stream = worker.client.generate(self._call(gen, rid, run, decision))
        try:
            async for piece in self._pieces(stream, run, self.spec.router.stall_seconds * 2 ** run.stalls):
                if piece.token_ids:
                    charge.first_token()
                    run.resumed()
                yield piece
                if piece.finish_reason is not None:
                    return
        except WorkerCallError as e:
            raise self._failure(e, worker, rid, run) from None
        except _Fatal as e:
            raise self._fatal(str(e), rid, run) from None
        finally:
            stream.cancel()
            charge.release()

    def _call(self, gen: GenerationSpec, rid: str, run: _Run, decision: Decision) -> GenerateCall:
        """The request from where it stands: after the tokens already sent, with what is left of its budget."""
        sp, n = gen.params, len(run.produced)
        params = sp if not n else replace(sp, max_tokens=sp.max_tokens - n, min_tokens=max(0, sp.min_tokens - n),
                                          output_offset=sp.output_offset + n)
        prefill = decision.prefill
        # after a bounce the call has an id of its own: the prefill worker may not have let go of the last one yet
        call_id = f"{rid}~{run.bounces}" if run.bounces else rid
        return GenerateCall(call_id, gen.prompt_token_ids, params, prefill.name if prefill else "", gen.priority,
                            tuple(run.produced))

    def _charge(self, decision: Decision, run: _Run) -> Charge:
        """The attempt's share of its workers' load, in KV blocks of its context, until it ends."""
        bs = self.spec.model.block_size
        context = run.num_prompt + len(run.produced)
        blocks = -(-context // bs)
        # charged to the worker that will compute the prompt: the decode worker prefills short ones itself
        remote = decision.prefill if context >= self.spec.decode.disagg_threshold else None
        return Charge(decision.decode, remote, blocks, blocks - decision.cached_tokens // bs)

    def _failure(self, e: WorkerCallError, worker: Worker, rid: str, run: _Run) -> Exception:
        """What a failed call means: bad input (before the first token), a worker gone (the request moves), or
        a failure for good."""
        if e.kind == "invalid" and not run.produced:
            return bad(e.details or "invalid request")
        if e.kind in ("unavailable", "cancelled", "closed"):
            self.workers.mark_down(worker, e.details)
            return _Moved(RetryReason.WORKER_GONE, e.details)
        return self._fatal(f"decode worker failed: {e.details}", rid, run)

    @staticmethod
    def _fatal(why: str, rid: str, run: _Run) -> APIError:
        """The worker failed the request for good: another would likely do the same."""
        if run.produced:
            log.warning("request %s failed on %s after %d tokens: %s", rid, run.endpoint, len(run.produced), why)
        return APIError(500, why, code="worker_error")

    def _may_not_move(self, rid: str, run: _Run, failed: _Moved) -> str | None:
        """Whether a failed attempt's request goes on elsewhere: None, or why its stream ends here instead."""
        if run.moving is not None:  # the worker it moved to failed as well
            run.moving.end("failed")
        run.moving = _Moving(failed.reason, run.last_token_at)
        if not run.produced:
            return None  # a plain retry on another worker
        run.moves += 1
        if failed.reason == RetryReason.STALL:
            run.stalls += 1
        limit = self.spec.router.migration_limit
        if run.moves > limit:
            run.moving.end("limit")
            log.warning("request %s: %s on %s after %d tokens; not moved (migrationLimit %d)", rid, failed.reason,
                        run.endpoint, len(run.produced), limit)
            return (f"the decode worker failed ({failed.details}) and the request may not move again "
                    f"(router.migrationLimit {limit})")
        log.warning("request %s moves off %s (%s: %s) after %d tokens", rid, run.endpoint, failed.reason,
                    failed.details, len(run.produced))
        return None

    def _cannot_resume(self) -> set[str]:
        """Workers that could not continue a moved request (their health does not list `resume`)."""
        return {w.info.name for w in self.workers.workers if "resume" not in w.capabilities}

    async def _pieces(self, stream: TokenStream, run: _Run, stall_s: float) -> AsyncIterator[Piece]:
        """One attempt's pieces. Raises `_Moved` when another worker may continue the request, `_Fatal` when
        the worker failed it for good, `WorkerCallError` when the call itself failed."""
        chunks = aiter(stream)
        first = True
        while True:
            try:
                # a new request's first token waits on its queue and prefill; a moved one's next worker gets twice
                # the window for its first (it computes the context again), not forever (it may be stopped)
                window = 2 * stall_s if first else stall_s
                if (first and not run.produced) or stall_s <= 0:
                    resp = await anext(chunks)
                else:
                    async with asyncio.timeout(window):
                        resp = await anext(chunks)
            except StopAsyncIteration:
                raise _Moved(RetryReason.WORKER_GONE, "the worker ended the stream before the request finished") from None
            except TimeoutError:
                raise _Moved(RetryReason.STALL, f"no token for {window:g} s") from None
            if resp.finish_reason in ("error", "abort") and resp.finished:
                if resp.retry:
                    raise _Moved(resp.retry, resp.error or f"finish_reason {resp.finish_reason}")
                raise _Fatal(f"generation failed: {resp.error}" if resp.error else "the request was aborted by the worker")
            if not run.moves:  # a worker that continues a moved request counts its own context, not the prompt's
                run.cached = max(run.cached, min(resp.cached_tokens, run.num_prompt))
            finish = resp.finish_reason if resp.finished else None
            if resp.token_ids:
                first = False
                run.produced.extend(resp.token_ids)
                run.last_token_at = time.monotonic()
            if run.detok.add_tokens(resp.token_ids) is not None:
                finish = "stop"
            yield run.piece(resp.token_ids, resp.logprobs, finish)
            if finish is not None:
                return


class _Moved(Exception):  # noqa: N818 (not an error: the request goes on elsewhere)
    """An attempt failed in a way another worker can recover from: it continues after the tokens sent."""

    def __init__(self, reason: RetryReason, details: str) -> None:
        super().__init__(details)
        self.reason = reason
        self.details = details


class _Fatal(Exception):  # noqa: N818
    """The worker failed the request for good (an error it did not mark retryable)."""


@dataclass
class _Moving:
    """A request on its way from a failed worker to another one."""

    reason: RetryReason
    since: float  # when its last token reached the gateway: the client waits from there

    def end(self, outcome: str) -> None:
        m.MIGRATIONS.labels(self.reason, outcome).inc()
        if outcome == "resumed":
            m.MIGRATION_GAP.observe(time.monotonic() - self.since)


@dataclass
class _Run:
    """One request's output across its attempts: the tokens sent, the detokenizer (stop strings apply across
    a move), and its usage."""

    detok: IncrementalDetokenizer
    num_prompt: int
    produced: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens its first worker did not compute
    tried: set[str] = field(default_factory=set)  # decode workers it went to
    endpoint: str = ""  # the latest one's
    worker: str = ""  # the latest one's name
    busy_until: dict[str, float] = field(default_factory=dict)  # decode workers that said busy: tried again after
    busy_since: float = 0.0  # time.monotonic() of its first bounce (0: none)
    bounces: int = 0  # times a decode worker sent it back busy
    moves: int = 0  # moves after the first token
    stalls: int = 0  # of which for a stall: each doubles its stall window (a slow worker does not ping-pong it)
    moving: _Moving | None = None  # on its way from a failed worker to another one
    last_token_at: float = field(default_factory=time.monotonic)

    def resumed(self) -> None:
        """A token came after a move: the move is done."""
        if self.moving is not None:
            self.moving.end("resumed")
            self.moving = None

    def piece(self, token_ids: list[int], logprobs: list[Logprob], finish: str | None) -> Piece:
        return Piece(self.detok.delta(finish is not None), list(token_ids), list(logprobs), finish, self.num_prompt,
                     len(self.produced), self.cached)

    def error_end(self, why: str) -> Piece:
        """The end of a stream that failed after its first token and cannot move: finish_reason error, usage."""
        piece = self.piece([], [], "error")
        piece.error = why
        return piece
