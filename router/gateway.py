"""The gateway's core, below HTTP: route a parsed request (policy + worker view), call the decode worker (its
`WorkerClient`) naming the prefill worker, and turn the token stream into text pieces.

The gateway owns detokenization and stop strings (the engine deals in token ids only): the engine's step loop
stays free of per-token text work, and gateways scale out independently of GPU workers. When a stop string
appears, the gateway ends the call, which aborts the request on the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

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
            session_slack=kv.session_slack_blocks)
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

    def features(self, gen: GenerationSpec) -> RequestFeatures:
        return RequestFeatures(gen.prompt_token_ids, self.spec.model.block_size, self.model_name,
                               gen.session_key, gen.params.max_tokens)

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
        """Pieces of output; tries another decode worker if one fails before its first token."""
        request = self.features(gen)
        tried: set[str] = set()
        while True:
            decision = await self._route(request, tried)
            m.DECISIONS.labels(self.policy.name, decision.reason).inc()
            m.PREFIX_HIT_TOKENS.inc(decision.cached_tokens)
            decode, prefill = decision.decode, decision.prefill
            tried.add(decode.name)
            worker = self.workers.get(decode.name)
            call = GenerateCall(rid, gen.prompt_token_ids, gen.params, prefill.name if prefill else "", gen.priority)
            sent_any = False
            bs = self.spec.model.block_size
            blocks = -(-request.num_prompt_tokens // bs)
            charge = Charge(decode, prefill, blocks, blocks - decision.cached_tokens // bs)
            stream = worker.client.generate(call)
            try:
                async for piece in self._pieces(stream, gen):
                    if piece.token_ids:
                        charge.first_token()
                    sent_any = True
                    yield piece
                return
            except WorkerCallError as e:
                if e.kind == "invalid":
                    raise bad(e.details or "invalid request") from None
                if e.kind in ("unavailable", "cancelled", "closed") and not sent_any:
                    self.workers.mark_down(worker, e.details)
                    continue
                if e.kind == "closed":
                    raise APIError(500, "the decode worker's connection closed mid-stream",
                                   code="worker_error") from None
                raise APIError(503 if not sent_any else 500, f"decode worker failed: {e.details}",
                               code="worker_error") from None
            finally:
                stream.cancel()
                charge.release()

    async def _pieces(self, stream: TokenStream, gen: GenerationSpec) -> AsyncIterator[Piece]:
        sp = gen.params
        detok = IncrementalDetokenizer(self.tokenizer, gen.prompt_token_ids, sp.stop, sp.include_stop_str_in_output)
        completion = cached = 0
        async for resp in stream:
            if resp.error and resp.finish_reason == "error":
                raise APIError(500, f"generation failed: {resp.error}", code="worker_error")
            cached = max(cached, resp.cached_tokens)
            completion += len(resp.token_ids)
            finish = resp.finish_reason if resp.finished else None
            if detok.add_tokens(resp.token_ids) is not None:
                finish = "stop"
            if finish == "abort":
                raise APIError(500, "the request was aborted by the worker", code="worker_error")
            yield Piece(detok.delta(finish is not None), list(resp.token_ids), list(resp.logprobs), finish,
                        len(gen.prompt_token_ids), completion, cached)
            if finish is not None:
                return
        raise APIError(500, "the worker ended the stream before the request finished", code="worker_error")
