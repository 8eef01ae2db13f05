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
from splitserve.common.worker_client import GenerateCall, TokenStream, WorkerCallError
from splitserve.router import metrics as m
from splitserve.router.cluster import ClusterState
from splitserve.router.errors import APIError, bad
from splitserve.router.openai_protocol import GenerationSpec
from splitserve.router.policy import Charge, RequestFeatures, RoutingPolicy, make_policy
from splitserve.router.workers import WorkerSet

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
            spill_local_tokens=spec.router.spill.local_backlog_tokens)
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

    async def _route(self, request: RequestFeatures, tried: set[str]):
        """A decision; while no decode worker is up but some are slow or starting, wait for one (bounded)."""
        deadline = time.monotonic() + self.spec.router.queue_timeout_seconds
        while True:
            decision = self.policy.route(request, self.workers, frozenset(tried))
            if decision is not None:
                return decision
            if not self.workers.alive("decode") or (tried and not self.workers.candidates("decode")
                                                    and not self._others_alive(tried)):
                raise APIError(503, "no decode worker is available", code="no_workers")
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(429, "no decode worker answered in time; retry later", code="workers_busy",
                               headers={"Retry-After": "5"})
            await self.workers.wait_for_change(min(left, 1.0))

    def _others_alive(self, tried: set[str]) -> bool:
        return any(w.load.serves("decode") and w.info.name not in tried and not w.load.draining and w.state != "down"
                   for w in self.workers.workers)

    async def generate(self, gen: GenerationSpec, rid: str) -> AsyncIterator[Piece]:
        """Pieces of output. A stream that fails mid-way (its worker died or dropped the connection, stalled
        past `stallSeconds`, ran out of drain time, or its engine stopped) moves to another decode worker, up
        to `migrationLimit` times: that worker continues after the tokens already sent, and the client sees one
        stream. A failure before the first token tries another worker as before (no limit: each worker once)."""
        rs = self.spec.router
        sp = gen.params
        run = _Run(IncrementalDetokenizer(self.tokenizer, gen.prompt_token_ids, sp.stop, sp.include_stop_str_in_output),
                   len(gen.prompt_token_ids))
        tried: set[str] = set()
        moving: _Moving | None = None
        while True:
            if len(run.produced) >= sp.max_tokens:  # it failed after its last token, before its end
                yield run.piece([], [], "length")
                return
            exclude = tried | self._cannot_resume() if run.produced else tried
            try:
                decision = await self._route(self.features(gen, gen.prompt_token_ids + run.produced), exclude)
            except APIError as e:
                if moving is None:
                    raise
                moving.end("no_worker")
                if not run.produced:
                    raise
                log.warning("request %s: no decode worker to continue it on (%s)", rid, e.message)
                yield run.error_end(e.message)
                return
            m.DECISIONS.labels(self.policy.name, decision.reason).inc()
            m.PREFIX_HIT_TOKENS.inc(decision.cached_tokens)
            decode, prefill = decision.decode, decision.prefill
            tried.add(decode.name)
            worker = self.workers.get(decode.name)
            n = len(run.produced)
            params = sp if not n else replace(sp, max_tokens=sp.max_tokens - n, min_tokens=max(0, sp.min_tokens - n),
                                              output_offset=sp.output_offset + n)
            call = GenerateCall(rid, gen.prompt_token_ids, params, prefill.name if prefill else "", gen.priority,
                                tuple(run.produced))
            bs = self.spec.model.block_size
            blocks = -(-(run.num_prompt + n) // bs)
            # charged to the worker that will compute the prompt: the decode worker prefills short ones itself
            remote = prefill if run.num_prompt + n >= self.spec.decode.disagg_threshold else None
            charge = Charge(decode, remote, blocks, blocks - decision.cached_tokens // bs)
            if decision.spilled:
                m.SPILLS.inc()
            stream = worker.client.generate(call)
            failed: _Moved | None = None
            fatal: str | None = None  # the worker failed the request for good: another would likely do the same
            try:
                async for piece in self._pieces(stream, run, rs.stall_seconds):
                    if piece.token_ids:
                        charge.first_token()
                        if moving is not None:
                            moving.end("resumed")
                            moving = None
                    yield piece
                    if piece.finish_reason is not None:
                        return
            except WorkerCallError as e:
                if e.kind == "invalid" and not run.produced:
                    raise bad(e.details or "invalid request") from None
                if e.kind in ("unavailable", "cancelled", "closed"):
                    self.workers.mark_down(worker, e.details)
                    failed = _Moved("worker_gone", e.details)
                else:
                    fatal = f"decode worker failed: {e.details}"
            except _Moved as e:
                failed = e
            except _Fatal as e:
                fatal = str(e)
            finally:
                stream.cancel()
                charge.release()
            if fatal is not None:
                if not run.produced:
                    raise APIError(500, fatal, code="worker_error")
                log.warning("request %s failed on %s after %d tokens: %s", rid, worker.endpoint, n, fatal)
                yield run.error_end(fatal)
                return
            assert failed is not None  # the loop above returns at its finish
            if moving is not None:  # the worker it moved to failed as well
                moving.end("failed")
            moving = _Moving(failed.reason, run.last_token_at)
            if run.produced:
                run.moves += 1
                if run.moves > rs.migration_limit:
                    moving.end("limit")
                    log.warning("request %s: %s on %s after %d tokens; not moved (migrationLimit %d)", rid,
                                failed.reason, worker.endpoint, len(run.produced), rs.migration_limit)
                    yield run.error_end(f"the decode worker failed ({failed.details}) and the request may not move "
                                        f"again (router.migrationLimit {rs.migration_limit})")
                    return
                log.warning("request %s moves off %s (%s: %s) after %d tokens", rid, worker.endpoint, failed.reason,
                            failed.details, len(run.produced))

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
                if first or stall_s <= 0:
                    resp = await anext(chunks)
                else:
                    async with asyncio.timeout(stall_s):
                        resp = await anext(chunks)
            except StopAsyncIteration:
                raise _Moved("worker_gone", "the worker ended the stream before the request finished") from None
            except TimeoutError:
                raise _Moved("stall", f"no token for {stall_s:g} s") from None
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

    def __init__(self, reason: str, details: str) -> None:
        super().__init__(details)
        self.reason = reason  # worker_gone | stall | drain | engine
        self.details = details


class _Fatal(Exception):  # noqa: N818
    """The worker failed the request for good (an engine error it did not mark retryable)."""


@dataclass
class _Moving:
    """A request on its way from a failed worker to another one."""

    reason: str
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
    moves: int = 0  # moves after the first token
    last_token_at: float = field(default_factory=time.monotonic)

    def piece(self, token_ids: list[int], logprobs: list[Logprob], finish: str | None) -> Piece:
        return Piece(self.detok.delta(finish is not None), list(token_ids), list(logprobs), finish, self.num_prompt,
                     len(self.produced), self.cached)

    def error_end(self, why: str) -> Piece:
        """The end of a stream that failed after its first token and cannot move: finish_reason error, usage."""
        piece = self.piece([], [], "error")
        piece.error = why
        return piece
