"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs."""

from __future__ import annotations

import random

import torch

from splitserve.engine.request import Logprob, Request
from splitserve.engine.scheduler import SampledToken


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            seed = request.sampling_params.seed
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if seed is not None else self._rng.getrandbits(63))
            self._generators[request.request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """logits: [N, vocab] float32, one row per request."""
        greedy = torch.argmax(logits, dim=-1)
        want_lp = [r.sampling_params.logprobs is not None for r in requests]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        chosen = greedy.tolist()
        for i, r in enumerate(requests):
            if not r.sampling_params.greedy:
                chosen[i] = self._sample_row(logits[i], r)
        out = []
        for i, r in enumerate(requests):
            lp = None
            if want_lp[i]:
                lp = _logprob(logprobs[i], chosen[i], r.sampling_params.logprobs)
            out.append(SampledToken(chosen[i], lp))
        return out

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        sp = request.sampling_params
        row = row.float() / sp.temperature
        if sp.top_k > 0 and sp.top_k < row.shape[-1]:
            kth = torch.topk(row, sp.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            cum = torch.cumsum(probs, dim=-1)
            drop = (cum - probs) > sp.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
        probs = torch.softmax(row, dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self._generator(request)).item())


def _logprob(row: torch.Tensor, token_id: int, top_n: int) -> Logprob:
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = torch.topk(row, top_n)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Logprob(token_id, float(row[token_id]), top)
