"""Sampling: seeded reproducibility, top-k/top-p, stop strings cut exactly, log-probabilities."""

from __future__ import annotations

import pytest
import torch
from support.helpers import make_engine

from splitserve.engine import SamplingParams


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine(smollm2_dir)


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a short story about a cat."}])


def test_same_seed_same_output_regardless_of_batch(engine, prompt):
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    alone = engine.generate([prompt], sp)[0]["token_ids"]
    other = SamplingParams(max_tokens=20, temperature=1.0, seed=99)
    batched = engine.generate([prompt, prompt, prompt], [other, sp, other])
    assert batched[1]["token_ids"] == alone
    different = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=1235))[0]
    assert different["token_ids"] != alone


def test_top_k_one_is_greedy(engine, prompt):
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]["token_ids"]
    k1 = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=5))[0]["token_ids"]
    assert k1 == greedy


def test_top_p_restricts_to_nucleus(engine, prompt):
    """With a tiny top_p only the most likely token survives, so sampling equals greedy."""
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]["token_ids"]
    nucleus = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=3))[0]
    assert nucleus["token_ids"] == greedy


def test_stop_string_cuts_text_exactly(engine, prompt):
    full = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    text = full["text"]
    words = text.split()
    assert len(words) > 5
    stop = words[4]
    cut = text[: text.find(stop)]
    res = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert res["text"] == cut
    assert res["finish_reason"] == "stop" and res["stop_reason"] == stop
    inc = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert inc["text"] == cut + stop


def test_stop_token_ids_and_max_tokens(engine, prompt):
    full = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert len(full["token_ids"]) == 10 and full["finish_reason"] == "length"
    stop_id = full["token_ids"][3]
    res = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id]))[0]
    assert res["token_ids"] == full["token_ids"][: full["token_ids"].index(stop_id) + 1]
    assert res["finish_reason"] == "stop" and res["stop_reason"] == stop_id


def test_logprobs_match_hf_log_softmax(engine, prompt, smollm2_dir):
    from transformers import AutoModelForCausalLM

    res = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=5))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    ids = torch.tensor([prompt + res["token_ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    for i, entry in enumerate(res["logprobs"]):
        row = lp[len(prompt) - 1 + i]
        assert entry.token_id == res["token_ids"][i]
        assert abs(entry.logprob - row[entry.token_id].item()) < 1e-3
        top_ids = torch.topk(row, 5).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids
        assert entry.top[0][0] == entry.token_id  # greedy picks the best


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(logprobs=50), dict(stop=[""]), dict(seed=-1)])
def test_invalid_params_name_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)
