"""The synchronous engine: schedule → run the model → update requests → emit outputs."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.block_pool import KVCacheEvent
from splitserve.engine.config import EngineConfig, KVCacheSpec, parse_memory
from splitserve.engine.kv_cache_manager import cdiv
from splitserve.engine.model_files import resolve_model
from splitserve.engine.model_runner import DTYPES, KVLayerHook, ModelRunner
from splitserve.engine.models.loader import load_arch, load_model
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import SampledToken, Scheduler
from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("splitserve.engine")

CPU_DEFAULT_KV_BYTES = 512 << 20


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer | None
    sent_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, on_kv_event: Callable[[KVCacheEvent], None] | None = None) -> None:
        self.config = config
        mc = config.model
        self.model_dir = resolve_model(mc.model, need_weights=mc.load_format != "dummy")
        self.model_name = mc.served_model_name or mc.model
        self.device = torch.device(mc.device if mc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype_name = mc.dtype if mc.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = DTYPES[dtype_name]
        self.arch = load_arch(self.model_dir)
        self.max_model_len = mc.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's {self.arch.max_position_embeddings} positions"
            )
        self.tokenizer = Tokenizer.maybe(self.model_dir)
        model = load_model(self.model_dir, self.device, self.dtype, self.max_model_len, dummy=mc.load_format == "dummy")
        block_size = config.cache.block_size
        self.runner = ModelRunner(model, self.arch, self.device, self.dtype, block_size, config.seed,
                                  cuda_graphs=not mc.enforce_eager, max_model_len=self.max_model_len,
                                  max_num_seqs=config.scheduler.max_num_seqs)
        num_blocks = self._num_kv_blocks()
        self.runner.init_kv_cache(num_blocks)
        self.kv_spec = KVCacheSpec(num_blocks, block_size, self.arch.num_layers, self.arch.num_kv_heads,
                                   self.arch.head_dim, dtype_name, str(self.device))
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len,
                                   salt=self.model_name, on_kv_event=on_kv_event)
        eos = set(self.arch.eos_token_ids) | (set(self.tokenizer.eos_token_ids) if self.tokenizer else set())
        self.eos_token_ids = frozenset(eos)
        self.kv_hook: KVLayerHook | None = None
        self._tracked: dict[str, _Tracked] = {}
        log.info("engine ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
                 self.model_name, self.device, dtype_name, num_blocks, block_size, self.max_model_len)

    def _num_kv_blocks(self) -> int:
        per_block = self.runner.bytes_per_block()
        setting = self.config.cache.kv_cache_memory
        if setting == "auto":
            # CPU: 512 MiB, or enough for two full-length sequences if that is more
            setting = 0.85 if self.device.type == "cuda" else max(
                CPU_DEFAULT_KV_BYTES, 2 * per_block * cdiv(self.max_model_len, self.config.cache.block_size))
        budget = parse_memory(setting)
        if isinstance(budget, float):
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
            else:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = int(free * budget)
        return max(1, budget // per_block)

    # -- requests -----------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     priority: int = 0, hold_blocks: bool = False) -> Request:
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, priority,
                       hold_blocks=hold_blocks)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    priority: int = 0, hold_blocks: bool = False) -> Request:
        request = self.make_request(request_id, prompt_token_ids, params, priority, hold_blocks)
        self.scheduler.add_request(request)
        self._track(request)
        return request

    def _track(self, request: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            sp = request.sampling_params
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, sp.stop, sp.include_stop_str_in_output)
        self._tracked[request.request_id] = _Tracked(request, detok)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        tracked = self._tracked.pop(request_id, None)
        self.runner.sampler.forget(request_id)
        if request is None or tracked is None:
            return None
        return RequestOutput(request_id, [], finished=True, finish_reason="abort",
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens)

    def release(self, request_id: str) -> bool:
        """Free a finished request's held blocks (prefill role, once its KV was sent)."""
        return self.scheduler.release(request_id)

    # -- disaggregation (decode role) ---------------------------------------------------------------
    def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       priority: int = 0) -> tuple[list[int], int] | None:
        """Reserve blocks for a prompt whose KV arrives from a prefill worker.

        Returns (block ids covering the whole prompt, prompt tokens already cached here), or None if full.
        """
        request = self.make_request(request_id, prompt_token_ids, params, priority)
        reserved = self.scheduler.reserve_remote(request)
        if reserved is not None:
            self._track(request)
        return reserved

    def admit_remote(self, request_id: str, first_token_id: int, first_logprob=None) -> RequestOutput:
        """The prompt KV landed: the request joins the batch, continuing after `first_token_id`."""
        request = self.scheduler.admit_remote(request_id, SampledToken(first_token_id, first_logprob))
        return self._emit(request, [SampledToken(first_token_id, first_logprob)])

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        sampled = self.runner.execute(sched, self.kv_hook)
        results = self.scheduler.update_from_output(sched, sampled)
        return [self._emit(request, tokens) for request, tokens in results]

    def _emit(self, request: Request, tokens: list[SampledToken]) -> RequestOutput:
        rid = request.request_id
        tracked = self._tracked[rid]
        text = ""
        detok = tracked.detok
        if detok is not None:
            before = len(detok.text)
            for t in tokens:
                detok.add(t.token_id)
            stop = detok.check_stop(len(detok.text) - before)
            if stop is not None:
                request.stop_reason = stop
                if request.is_finished:  # also hit EOS or length on this token: the stop string wins
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            text = detok.delta(request.is_finished)
        out = RequestOutput(
            request_id=rid,
            new_token_ids=[t.token_id for t in tokens],
            new_logprobs=[t.logprob for t in tokens if t.logprob is not None],
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_output_tokens=request.num_output_tokens,
        )
        if request.is_finished:
            self._tracked.pop(rid, None)
            self.runner.sampler.forget(rid)
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> dict[str, int]:
        return self.scheduler.stats()

    # -- offline helper -----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[dict]:
        """Run prompts to completion; returns per prompt {token_ids, text, finish_reason, logprobs}."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        results: dict[str, dict] = {}
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            rid = f"gen-{id(self)}-{i}"
            self.add_request(rid, p, sp)
            results[rid] = {"token_ids": [], "text": "", "finish_reason": None, "logprobs": []}
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r["token_ids"].extend(out.new_token_ids)
                r["logprobs"].extend(out.new_logprobs)
                r["text"] += out.new_text
                if out.finished:
                    r["finish_reason"] = out.finish_reason
                    r["stop_reason"] = out.stop_reason
        return list(results.values())
