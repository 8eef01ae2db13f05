"""The synchronous engine: schedule → run the model → update requests → emit outputs."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.engine.block_pool import KVCacheEvent
from splitserve.engine.config import EngineConfig, KVCacheSpec, parse_memory
from splitserve.engine.kv_cache_manager import cdiv
from splitserve.engine.model_files import resolve_model
from splitserve.engine.model_runner import DTYPES, KVLayerHook, ModelRunner
from splitserve.engine.models.loader import load_arch, load_model
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.parallel import ParallelContext, check_shardable
from splitserve.engine.parallel_worker import rank_device, start_followers, stop_followers
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


def build_runner(config: EngineConfig, device: torch.device,
                 parallel: ParallelContext | None = None) -> tuple[ModelRunner, int, Path]:
    """Load the model (this rank's shard under tensor parallelism) and size and allocate its KV cache.

    Returns the runner, the number of KV blocks (the minimum over all ranks) and the model directory.
    """
    mc = config.model
    model_dir = resolve_model(mc.model, need_weights=mc.load_format != "dummy")
    dtype_name = mc.dtype if mc.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    arch = load_arch(model_dir)
    max_model_len = mc.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {arch.max_position_embeddings} positions")
    model = load_model(model_dir, device, dtype, max_model_len, dummy=mc.load_format == "dummy", parallel=parallel)
    runner = ModelRunner(model, arch, device, dtype, config.cache.block_size, config.seed,
                         cuda_graphs=not mc.enforce_eager, max_model_len=max_model_len,
                         max_num_seqs=config.scheduler.max_num_seqs, parallel=parallel)
    num_blocks = _num_kv_blocks(config, runner, device, max_model_len)
    if parallel is not None and parallel.world_size > 1:
        num_blocks = parallel.agree_min(num_blocks)
    runner.init_kv_cache(num_blocks)
    return runner, num_blocks, model_dir


def _num_kv_blocks(config: EngineConfig, runner: ModelRunner, device: torch.device, max_model_len: int) -> int:
    per_block = runner.bytes_per_block()
    setting = config.cache.kv_cache_memory
    if setting == "auto":
        # CPU: 512 MiB, or enough for two full-length sequences if that is more
        setting = 0.85 if device.type == "cuda" else max(
            CPU_DEFAULT_KV_BYTES, 2 * per_block * cdiv(max_model_len, config.cache.block_size))
    budget = parse_memory(setting)
    if isinstance(budget, float):
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(free * budget)
    return max(1, budget // per_block)


class LLMEngine:
    def __init__(self, config: EngineConfig, on_kv_event: Callable[[KVCacheEvent], None] | None = None) -> None:
        self.config = config
        mc = config.model
        self.model_name = mc.served_model_name or mc.model
        self.device = rank_device(config, 0)
        self.parallel: ParallelContext | None = None
        self._followers: list = []
        if config.parallel.tensor_parallel_size > 1:
            arch = load_arch(resolve_model(mc.model, need_weights=mc.load_format != "dummy"))
            check_shardable(arch, config.parallel.tensor_parallel_size, config.parallel.expert_parallel)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            # the followers load their shards while this process loads its own
            self.parallel, self._followers = start_followers(config, self.device)
        self.runner, num_blocks, self.model_dir = build_runner(config, self.device, self.parallel)
        self.arch, self.dtype = self.runner.arch, self.runner.dtype
        self.max_model_len = self.runner.max_model_len
        block_size = config.cache.block_size
        self.tokenizer = Tokenizer.maybe(self.model_dir)
        dtype_name = next(k for k, v in DTYPES.items() if v == self.dtype)
        self.kv_spec = KVCacheSpec(num_blocks, block_size, self.arch.num_layers, self.runner.num_kv_heads,
                                   self.arch.head_dim, dtype_name, str(self.device))
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len,
                                   salt=self.model_name, on_kv_event=on_kv_event)
        eos = set(self.arch.eos_token_ids) | (set(self.tokenizer.eos_token_ids) if self.tokenizer else set())
        self.eos_token_ids = frozenset(eos)
        self._kv_hook: KVLayerHook | None = None
        self._tracked: dict[str, _Tracked] = {}
        log.info("engine ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d tp=%d",
                 self.model_name, self.device, dtype_name, num_blocks, block_size, self.max_model_len,
                 config.parallel.tensor_parallel_size)

    @property
    def kv_hook(self) -> KVLayerHook | None:
        return self._kv_hook

    @kv_hook.setter
    def kv_hook(self, hook: KVLayerHook | None) -> None:
        if hook is not None and self.parallel is not None:
            raise ValueError("streaming KV to another worker is not supported with tensor_parallel_size > 1")
        self._kv_hook = hook

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one device)."""
        if self.parallel is not None:
            self.runner.graphs = None  # graphs hold the communicators: release them first
            stop_followers(self.parallel, self._followers)
            self.parallel = None

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
