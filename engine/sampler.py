"""Token sampling: greedy, temperature, top-k, top-p, logprobs; seeded draws keyed by (seed, output position).

A sampled row draws one uniform, `position_uniform(seed, position)`, and takes the token where it falls in the
row's cumulative distribution (inverse CDF). Nothing carries from one draw to the next, so the token at output
position k is the same whichever process samples it: colocated, a prefill worker's first token then a decode
worker's, tensor-parallel, or a request resumed at k (`SamplingParams.output_offset`), on the same device and
dtype. Rows are sampled batched, on the logits' device; each row's result depends on that row alone.
"""

from __future__ import annotations

import random

import torch

from splitserve.common.sampling import position_uniform
from splitserve.engine.request import Logprob, Request
from splitserve.engine.scheduler import SampledToken


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._seeds: dict[str, int] = {}  # requests sampled without a seed (offline use): one drawn at first sight

    def forget(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)

    def _seed(self, request: Request) -> int:
        seed = request.sampling_params.seed
        if seed is None:
            seed = self._seeds.setdefault(request.request_id, self._rng.getrandbits(63))
        return seed

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """logits: [N, vocab] float32, one row per request."""
        greedy = torch.argmax(logits, dim=-1)
        want_lp = [r.sampling_params.logprobs is not None for r in requests]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        chosen = greedy.tolist()
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if rows:
            for i, token in zip(rows, self._sample_rows(logits, [requests[i] for i in rows], rows), strict=True):
                chosen[i] = token
        out = []
        for i, r in enumerate(requests):
            lp = None
            if want_lp[i]:
                lp = _logprob(logprobs[i], chosen[i], r.sampling_params.logprobs)
            out.append(SampledToken(chosen[i], lp))
        return out

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> list[int]:
        dev = logits.device
        x = logits.index_select(0, torch.tensor(rows, device=dev)).float()  # [n, vocab]
        x = x / torch.tensor([r.sampling_params.temperature for r in requests], device=dev).unsqueeze(1)
        # The output position this draw fills: tokens produced here (not counting ones still on the device) plus
        # those produced before the request started.
        u = [position_uniform(self._seed(r), r.sampling_params.output_offset + r.num_output_tokens - r.num_pending)
             for r in requests]
        tokens = [0] * len(requests)
        plain = [j for j, r in enumerate(requests) if not _filtered(r)]
        if plain:
            picked = _inverse_cdf(x[plain], [u[j] for j in plain]).tolist()
            for j, t in zip(plain, picked, strict=True):
                tokens[j] = t
        cut = [j for j, r in enumerate(requests) if _filtered(r)]
        if cut:
            picked = _sample_top_k_top_p(x[cut], [requests[j] for j in cut], [u[j] for j in cut]).tolist()
            for j, t in zip(cut, picked, strict=True):
                tokens[j] = t
        return tokens


def _filtered(r: Request) -> bool:
    sp = r.sampling_params
    return sp.top_k > 0 or sp.top_p < 1.0


def _inverse_cdf(x: torch.Tensor, u: list[float]) -> torch.Tensor:
    """x: [n, vocab] logits (-inf: excluded); u: a uniform per row. The index where each u falls in its row's
    cumulative distribution, in float64 so that tokens of tiny probability keep their share."""
    cum = torch.cumsum(torch.softmax(x, dim=-1, dtype=torch.float64), dim=-1)  # [n, vocab]
    total = cum[:, -1:]
    target = torch.tensor(u, dtype=torch.float64, device=x.device).unsqueeze(1) * total
    # strictly below the total, so the index found is a token with probability > 0 (never the excluded tail)
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=x.shape[-1] - 1)


def _sample_top_k_top_p(x: torch.Tensor, requests: list[Request], u: list[float]) -> torch.Tensor:
    """Top-k, then top-p over what top-k kept, then the draw, all in each row's descending order."""
    dev = x.device
    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [n, vocab]
    rank = torch.arange(vocab, device=dev).unsqueeze(0)
    k = torch.tensor([r.sampling_params.top_k or vocab for r in requests], device=dev).unsqueeze(1)
    sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
    top_p = torch.tensor([r.sampling_params.top_p for r in requests], device=dev).unsqueeze(1)
    probs = torch.softmax(sorted_x, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    drop = (cum - probs) > top_p  # keep the smallest prefix whose mass reaches top_p
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    picked = _inverse_cdf(sorted_x, u)
    return order.gather(1, picked.unsqueeze(1)).squeeze(1)


def _logprob(row: torch.Tensor, token_id: int, top_n: int) -> Logprob:
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = torch.topk(row, top_n)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Logprob(token_id, float(row[token_id]), top)
