"""Seeded sampling is keyed by (seed, output position): the same tokens wherever a position is sampled
(alone or batched, a resumed request at its offset), different seeds differ; colocated against prefill-then-decode
is tests/e2e/test_seeded_sampling_clusters.py."""

from __future__ import annotations

import pytest
import torch
from support.helpers import make_engine

from splitserve.common.protocol.convert import params_from_pb, params_to_pb
from splitserve.common.sampling import SamplingParams, position_uniform
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler

VOCAB = 64


def _request(rid: str, num_output: int = 0, **sp) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=100, **sp))
    r.output_token_ids = [5] * num_output
    return r


def _logits(n: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 2  # [n, vocab]


def _sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    return [t.token_id for t in Sampler().sample(logits, requests)]


def test_position_uniform_is_keyed_and_in_range():
    u = [position_uniform(7, k) for k in range(1000)]
    assert all(0.0 <= x < 1.0 for x in u)
    assert u == [position_uniform(7, k) for k in range(1000)]
    assert len(set(u)) == 1000
    assert abs(sum(u) / len(u) - 0.5) < 0.05
    assert position_uniform(8, 0) != position_uniform(7, 0)


@pytest.mark.parametrize("filters", [{}, {"top_k": 10}, {"top_p": 0.8}, {"top_k": 20, "top_p": 0.9}])
def test_position_k_with_offset_equals_position_k_of_a_full_run(filters):
    logits = _logits()
    for k in (0, 1, 5, 37):
        full = _sample(logits, [_request("a", num_output=k, seed=11, temperature=0.8, **filters)])
        resumed = _sample(logits, [_request("b", seed=11, temperature=0.8, output_offset=k, **filters)])
        assert full == resumed, k
        # a request resumed at j that has since produced k - j tokens itself is at the same position
        partly = _sample(logits, [_request("c", num_output=k - k // 2, seed=11, temperature=0.8,
                                           output_offset=k // 2, **filters)])
        assert partly == full


def test_a_row_samples_the_same_alone_or_in_any_batch():
    logits = _logits(4, seed=1)
    reqs = [_request("g", temperature=0.0), _request("s", seed=3, temperature=1.0, top_p=0.9),
            _request("t", seed=4, temperature=0.7, top_k=5), _request("u", seed=5, temperature=1.2)]
    batched = _sample(logits, reqs)
    alone = [_sample(logits[i : i + 1], [r])[0] for i, r in enumerate(reqs)]
    assert batched == alone
    assert batched[0] == int(torch.argmax(logits[0]))


def test_different_seeds_differ():
    logits = torch.zeros(1, VOCAB)  # uniform: any difference comes from the draws
    runs = {tuple(_sample(logits, [_request("a", num_output=k, seed=seed)])[0] for k in range(8))
            for seed in range(5)}
    assert len(runs) == 5


def test_draws_follow_the_distribution_and_respect_top_k_top_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs).unsqueeze(0)  # -inf beyond the first four
    n = 2000
    counts = torch.zeros(VOCAB)
    top2 = torch.zeros(VOCAB)
    for k in range(n):
        counts[_sample(logits, [_request("a", num_output=k, seed=99)])[0]] += 1
        top2[_sample(logits, [_request("a", num_output=k, seed=99, top_k=2)])[0]] += 1
    freq = counts / n
    assert torch.allclose(freq[:4], probs[:4], atol=0.04), freq[:4]  # 2000 draws: std of a share <= 0.012
    assert counts[4:].sum() == 0
    assert top2[2:].sum() == 0 and abs(top2[0] / n - 0.5 / 0.8) < 0.04
    nucleus = {_sample(logits, [_request("a", num_output=k, seed=1, top_p=0.45)])[0] for k in range(200)}
    assert nucleus == {0}  # the smallest prefix whose mass reaches top_p


def test_unseeded_requests_get_a_fixed_seed_per_request():
    logits = torch.zeros(1, VOCAB)
    s = Sampler(seed=0)
    r = _request("x")
    first = [s.sample(logits, [_request("x", num_output=k)])[0].token_id for k in range(6)]
    assert [s.sample(logits, [_request("x", num_output=k)])[0].token_id for k in range(6)] == first
    s.forget(r.request_id)


def test_output_offset_crosses_the_wire_and_is_validated():
    p = SamplingParams(max_tokens=4, seed=5, output_offset=12)
    assert params_from_pb(params_to_pb(p)).output_offset == 12
    assert params_from_pb(params_to_pb(SamplingParams())).output_offset == 0
    with pytest.raises(ValueError, match="output_offset"):
        SamplingParams(output_offset=-1)


def test_the_gateway_seeds_sampled_requests_only():
    from splitserve.router.openai_protocol import sampling

    sampled, _ = sampling({"temperature": 0.7}, 10, 100, chat=True)
    assert sampled.seed is not None
    assert sampling({"temperature": 0.7}, 10, 100, chat=True)[0].seed != sampled.seed
    assert sampling({"temperature": 0.7, "seed": 3}, 10, 100, chat=True)[0].seed == 3
    assert sampling({"temperature": 0}, 10, 100, chat=True)[0].seed is None
    assert sampling({"top_k": 1}, 10, 100, chat=True)[0].seed is None


# -- the real model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine(smollm2_dir)


def test_a_resumed_request_continues_as_the_full_run(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story about a fox."}])
    sp = dict(temperature=1.0, top_p=0.95, seed=2024, ignore_eos=True)
    full = engine.generate([prompt], SamplingParams(max_tokens=16, **sp))[0]["token_ids"]
    k = 6
    resumed = engine.generate([prompt + full[:k]], SamplingParams(max_tokens=16 - k, output_offset=k, **sp))[0]
    assert full[:k] + resumed["token_ids"] == full
    other = engine.generate([prompt], SamplingParams(max_tokens=16, **(sp | {"seed": 2025})))[0]["token_ids"]
    assert other != full
