"""The synchronous engine: schedule → run the model → update requests → emit outputs.

It deals in token ids only: text, and the stop strings that need it, belong to whoever reads the outputs (the
gateway when serving, `generate` below offline), through `splitserve.common.text.IncrementalDetokenizer`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from splitserve.common.model_files import resolve_model
from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.common.text import IncrementalDetokenizer, Tokenizer
from splitserve.engine.block_pool import KVCacheEvent
from splitserve.engine.config import EngineConfig, KVCacheSpec
from splitserve.engine.interface import KVEventListener, ModelFacts
from splitserve.engine.layer_hooks import KVLayerHook
from splitserve.engine.loading import build_runner, rank_device
from splitserve.engine.model_runner import DTYPES, InFlight
from splitserve.engine.models.loader import load_arch
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.parallel import KVShard, ParallelContext, check_shardable, replicate_kv_heads
from splitserve.engine.parallel_link import RankLink
from splitserve.engine.parallel_worker import start_followers, stop_followers
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.scheduler import SampledToken, Scheduler
from splitserve.engine.step_batch import send_kv_copy

log = logging.getLogger("splitserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.model_name = mc.served_model_name or mc.model
        self.device = rank_device(config, 0)
        self.parallel: ParallelContext | None = None
        self._followers: list = []
        self._links: list[RankLink] = []
        if config.parallel.tensor_parallel_size > 1:
            arch = load_arch(resolve_model(mc.model, need_weights=False))
            check_shardable(arch, config.parallel.tensor_parallel_size, config.parallel.expert_parallel)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            # the followers load their shards while this process loads its own
            self.parallel, self._followers, self._links = start_followers(config, self.device)
        self.runner, num_blocks, self.model_dir = build_runner(config, self.device, self.parallel)
        self.arch, self.dtype = self.runner.arch, self.runner.dtype
        self.max_model_len = self.runner.max_model_len
        block_size = config.cache.block_size
        self.tokenizer = Tokenizer.maybe(self.model_dir)
        dtype_name = next(k for k, v in DTYPES.items() if v == self.dtype)
        self.kv_spec = KVCacheSpec(num_blocks, block_size, self.arch.num_layers, self.runner.num_kv_heads,
                                   self.arch.head_dim, dtype_name, str(self.device))
        self.kv_shard = KVShard.of(self.arch.num_kv_heads, 0, config.parallel.tensor_parallel_size)
        self._kv_listeners: list[KVEventListener] = []
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len,
                                   salt=self.model_name, on_kv_event=self._on_kv_event)
        eos = set(self.arch.eos_token_ids) | (set(self.tokenizer.eos_token_ids) if self.tokenizer else set())
        self.eos_token_ids = frozenset(eos)
        self.facts = ModelFacts(self.model_name, self.arch.vocab_size, self.max_model_len, self.eos_token_ids,
                                config.parallel.tensor_parallel_size, str(self.device), block_size, num_blocks)
        self.layer_hooks: list[KVLayerHook] = []
        # Overlapped decode: a step of greedy decodes is launched before the previous one's tokens are read, so
        # the host's scheduling and output work hides behind the device. On CPU a "launch" is the whole step, so
        # there it would only delay every token by a step: off unless asked (tests turn it on).
        self.overlap = self.device.type == "cuda"
        self._inflight: InFlight | None = None
        self._ready: list[RequestOutput] = []  # outputs of a step read outside `step`, handed out by the next one
        log.info("engine ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d tp=%d",
                 self.model_name, self.device, dtype_name, num_blocks, block_size, self.max_model_len,
                 config.parallel.tensor_parallel_size)

    def add_layer_hook(self, hook: KVLayerHook) -> None:
        if self.parallel is not None and not callable(getattr(hook, "rank_plan", None)):
            raise ValueError("under tensor_parallel_size > 1 a per-layer KV hook must plan the other ranks' part "
                             "(rank_plan)")
        self.layer_hooks.append(hook)

    def remove_layer_hook(self, hook: KVLayerHook) -> None:
        if hook in self.layer_hooks:
            self.layer_hooks.remove(hook)

    def follower_links(self) -> list[RankLink]:
        """Message links to ranks 1..N-1 (index r-1 for rank r); empty on one device."""
        return list(self._links)

    def add_kv_event_listener(self, listener: KVEventListener) -> None:
        self._kv_listeners.append(listener)

    def _on_kv_event(self, event: KVCacheEvent) -> None:
        for listener in self._kv_listeners:
            listener(event)

    def kv_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.runner.kv_caches

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one device)."""
        self._settle()
        if self.parallel is not None:
            self.runner.graphs = None  # graphs hold the communicators: release them first
            stop_followers(self.parallel, self._followers)
            self.parallel = None
            for link in self._links:
                link.close()

    # -- requests -----------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     priority: int = 0, hold_blocks: bool = False) -> Request:
        vocab = self.arch.vocab_size
        if prompt_token_ids and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, priority,
                       hold_blocks=hold_blocks)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    priority: int = 0, hold_blocks: bool = False) -> Request:
        request = self.make_request(request_id, prompt_token_ids, params, priority, hold_blocks)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request wherever it is (held blocks are released too); None if it was unknown or done."""
        self._settle()
        known = self.scheduler.requests.get(request_id)
        live = known is not None and not known.is_finished
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.runner.sampler.forget(request_id)
        if not live or request is None or request.status != RequestStatus.FINISHED_ABORTED:
            return None
        # tokens read by the settle above but not handed out yet are dropped: the caller has stopped listening
        unsent = sum(len(o.new_token_ids) for o in self._ready if o.request_id == request_id)
        self._ready = [o for o in self._ready if o.request_id != request_id]
        return RequestOutput(request_id, [], finished=True, finish_reason="abort",
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens - unsent)

    def release(self, request_id: str) -> bool:
        """Free a finished request's held blocks (prefill role, once its KV was sent)."""
        self._settle()
        return self.scheduler.release(request_id)

    # -- disaggregation (decode role) ---------------------------------------------------------------
    def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       priority: int = 0, hold_blocks: bool = False) -> tuple[list[int], int] | None:
        """Reserve blocks for a prompt whose KV arrives from outside (a prefill worker, the KV pool).

        Returns (block ids covering the whole prompt, prompt tokens already cached here), or None if full.
        """
        self._settle()
        request = self.make_request(request_id, prompt_token_ids, params, priority, hold_blocks)
        return self.scheduler.reserve_remote(request)

    # -- KV blocks in and out (the KV pool) ---------------------------------------------------------
    def export_blocks(self, block_hashes: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """Copies of the cached blocks with these hashes (those still cached): (their hashes, uint8 CPU tensor
        [n, bytes per block] laid out [layer, K/V, block_size, kv_heads, head_dim] per block)."""
        self._settle()
        cached = self.scheduler.pool.cached
        found = [h for h in block_hashes if h in cached]
        return found, self.runner.read_blocks([cached[h] for h in found])

    def load_blocks(self, request_id: str, first_block: int, data: torch.Tensor) -> None:
        """Write `data` ([n, bytes per block], from `export_blocks` on any worker of the same layout) into blocks
        first_block..first_block+n of a reserved request, and admit it to compute the rest of its prompt."""
        self._settle()
        block_ids = self.scheduler.kv.get_block_ids(request_id)[first_block : first_block + len(data)]
        if len(block_ids) != len(data):
            raise ValueError(f"{request_id}: {len(data)} blocks do not fit its reservation")
        self.runner.write_blocks(block_ids, data)
        self.scheduler.admit_loaded(request_id, (first_block + len(data)) * self.kv_spec.block_size)

    def admit_remote(self, request_id: str, first_token_id: int, first_logprob: Logprob | None = None) -> RequestOutput:
        """The prompt KV landed: the request joins the batch, continuing after `first_token_id`.

        Under tensor parallelism with fewer KV heads than ranks, the KV landed on each head's first holder: the
        ranks sharing a head copy it from there first."""
        self._settle()
        if self.parallel is not None and self.kv_shard.replicated:
            blocks = self.scheduler.kv.get_block_ids(request_id)
            if blocks:
                send_kv_copy(self.parallel, blocks)
                replicate_kv_heads(self.parallel, self.runner.kv_caches, blocks, self.arch.num_kv_heads)
        request = self.scheduler.admit_remote(request_id, SampledToken(first_token_id, first_logprob))
        return self._emit(request, [SampledToken(first_token_id, first_logprob)])

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._ready = self._ready, []
        prev, self._inflight = self._inflight, None
        if prev is not None:
            if self._can_follow():
                # every running request decodes from a token still on the device: launch the next step behind
                # `prev` first, then read `prev`'s tokens while the device runs it
                sched = self.scheduler.schedule()
                if not sched.is_empty:
                    self._launch(sched, prev)
                return outputs + self._commit(prev)
            outputs += self._commit(prev)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        if self._overlappable(sched):
            self._launch(sched, None)
            return outputs
        sampled = self.runner.execute(sched, self.layer_hooks)
        results = self.scheduler.update_from_output(sched, sampled)
        return outputs + [self._emit(request, tokens) for request, tokens in results]

    # -- the overlapped decode step -----------------------------------------------------------------
    def _overlappable(self, sched) -> bool:
        """A step may be launched without reading its tokens: greedy single-token decodes (sampled by one
        argmax on the device), on one device, with no layer hooks."""
        if not self.overlap or self.layer_hooks or self.parallel is not None:
            return False
        return all(s.num_new_tokens == 1 and s.sample and s.request.sampling_params.greedy
                   and s.request.sampling_params.logprobs is None for s in sched.scheduled)

    def _can_follow(self) -> bool:
        """The next step can run right behind the one in flight: nothing waits to be admitted and every running
        request was in the step in flight (so the next step is its decodes again)."""
        if not self.overlap or self.layer_hooks or self.scheduler.waiting:
            return False
        return all(r.num_pending for r in self.scheduler.running)

    def _launch(self, sched, prev: InFlight | None) -> None:
        self._inflight = self.runner.launch(sched.scheduled, prev)
        self.scheduler.launch(sched)

    def _commit(self, step: InFlight) -> list[RequestOutput]:
        """Read a launched step's tokens and apply them (stops, block caching), as `update_from_output` does."""
        outputs = []
        for s, token_id in zip(step.scheduled, step.token_ids(), strict=True):
            request = s.request
            if request.status != RequestStatus.RUNNING or not request.num_pending:
                continue  # aborted, stopped or preempted after the launch: its token is void
            token = SampledToken(token_id)
            self.scheduler.commit_token(request, token)
            outputs.append(self._emit(request, [token]))
        return outputs

    def _settle(self) -> None:
        """Read the step in flight, if any, before something from outside touches requests or blocks (its
        outputs go out with the next `step`)."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._ready += self._commit(step)

    def _emit(self, request: Request, tokens: list[SampledToken]) -> RequestOutput:
        out = RequestOutput(
            request_id=request.request_id,
            new_token_ids=[t.token_id for t in tokens],
            new_logprobs=[t.logprob for t in tokens if t.logprob is not None],
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_loaded_tokens=request.num_loaded_tokens,
            num_output_tokens=request.num_output_tokens - request.num_pending,
        )
        if request.is_finished:
            self.runner.sampler.forget(request.request_id)
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None or bool(self._ready)

    def stats(self) -> dict[str, int]:
        return self.scheduler.stats()

    # -- offline helper -----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[dict]:
        """Run prompts to completion; returns per prompt {token_ids, text, finish_reason, stop_reason, logprobs}.

        Text and stop strings come from the detokenizer, as in serving (no tokenizer: no text, no stop strings).
        """
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        results: dict[str, dict] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            rid = f"gen-{id(self)}-{i}"
            self.add_request(rid, p, sp)
            results[rid] = {"token_ids": [], "text": "", "finish_reason": None, "stop_reason": None, "logprobs": []}
            if self.tokenizer is not None:
                detoks[rid] = IncrementalDetokenizer(self.tokenizer, p, sp.stop, sp.include_stop_str_in_output)
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r["token_ids"].extend(out.new_token_ids)
                r["logprobs"].extend(out.new_logprobs)
                finished, reason, stop = out.finished, out.finish_reason, out.stop_reason
                detok = detoks.get(out.request_id)
                if detok is not None:
                    hit = detok.add_tokens(out.new_token_ids)
                    if hit is not None:
                        if not finished:
                            self.abort_request(out.request_id)
                        finished, reason, stop = True, "stop", hit
                    r["text"] += detok.delta(finished)
                if finished:
                    r["finish_reason"], r["stop_reason"] = reason, stop
        return list(results.values())
