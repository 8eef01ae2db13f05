"""Batch invariance (`engine.batchInvariant`), bit for bit: with SmolLM2 on the CPU, the logits of every sampled
position and the KV of every prompt position are `torch.equal` to a colocated worker's cold run of the same
prompt, whether the prompt was computed whole or in chunks, beside seven other requests, on a prefill worker
whose KV a decode worker received, after a prefix-cache hit, after a load from the KV pool, or by a worker that
resumes a moved request (its earlier output recomputed as prompt instead of decoded). The kernels underneath are
checked on their own: the tiled attention row by row, the packed matmuls row by row at every batch size.

The handover and the pool are driven here by the engine calls their code makes (reserve, write or load blocks,
admit); the real processes run in tests/e2e/test_seed_placements.py."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from splitserve.engine.kernels import tiled_attention
from splitserve.engine.kernels.cpu_linear import PackedLinear, packed_linear_available
from splitserve.engine.llm_engine import LLMEngine

LENGTHS = [20, 32, 33, 257, 700]  # short, a block's end and one past it, one past a KV tile, long
OUT = 4  # sampled positions compared per request


class Tap:
    """Records the logits row each request is sampled from, by request id (wraps the engine's sampler)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        sampler = engine.runner.sampler
        inner = sampler.sample

        def sample(logits, requests):
            for i, r in enumerate(requests):
                self.rows[r.request_id].append(logits[i].clone())
            return inner(logits, requests)

        sampler.sample = sample


def make(model_dir, *, budget: int, prefix_caching: bool) -> tuple[LLMEngine, Tap]:
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), dtype="float32", device="cpu", max_model_len=1024, batch_invariant=True),
        cache=CacheConfig(block_size=16, kv_cache_memory="64MiB", enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16),
    ))
    return engine, Tap(engine)


@pytest.fixture(scope="module")
def whole(smollm2_dir):
    """The colocated reference: no prefix cache, every prompt computed in one step."""
    return make(smollm2_dir, budget=2048, prefix_caching=False)


@pytest.fixture(scope="module")
def chunked(smollm2_dir):
    """Another worker: prompts in chunks of 100 tokens (boundaries inside blocks and tiles), a prefix cache."""
    return make(smollm2_dir, budget=100, prefix_caching=True)


def prompt(length: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * length + salt)
    return torch.randint(100, 40000, (length,), generator=g).tolist()


def params(n: int = OUT, offset: int = 0, seed: int = 7) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.9, seed=seed, ignore_eos=True, output_offset=offset)


def run(engine: LLMEngine, rid: str, tokens: list[int], sp: SamplingParams, hold: bool = True) -> list[int]:
    """Run one request (and whatever else is queued) to the end; its output tokens. Its blocks stay held."""
    engine.add_request(rid, tokens, sp, hold_blocks=hold)
    return drain(engine)[rid]


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def kv(engine: LLMEngine, rid: str, num_tokens: int) -> torch.Tensor:
    """The KV of a request's first `num_tokens` positions: [layers, K/V, tokens, kv_heads, head_dim]."""
    blocks = engine.scheduler.kv.get_block_ids(rid)
    data = engine.runner.read_blocks(list(blocks)).view(engine.dtype)
    shape = engine.runner.block_payload_shape()  # [layers, 2, block_size, kv_heads, head_dim]
    per = data.view(len(blocks), *shape).permute(1, 2, 0, 3, 4, 5).reshape(shape[0], 2, -1, *shape[3:])
    return per[:, :, :num_tokens].clone()


def reference(whole, tokens: list[int], rid: str, n: int = OUT) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """Logits of the first `n` sampled positions, KV of prompt + output and the output, colocated and cold."""
    engine, tap = whole
    out = run(engine, rid, tokens, params(n))
    cache = kv(engine, rid, len(tokens) + n - 1)
    engine.release(rid)
    return tap.rows[rid], cache, out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- placements ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_then_cached_equals_whole(whole, chunked, length):
    tokens = prompt(length, 1)
    logits, cache, out = reference(whole, tokens, f"ref-c{length}")
    engine, tap = chunked
    assert run(engine, f"cold-{length}", tokens, params()) == out
    assert same(tap.rows[f"cold-{length}"], logits)
    assert torch.equal(kv(engine, f"cold-{length}", len(tokens) + OUT - 1), cache)
    engine.release(f"cold-{length}")
    # the same prompt again: its full blocks come from the prefix cache, the rest is computed after them
    assert run(engine, f"hit-{length}", tokens, params()) == out
    assert engine.scheduler.requests[f"hit-{length}"].num_cached_tokens == (length - 1) // 16 * 16
    assert same(tap.rows[f"hit-{length}"], logits)
    assert torch.equal(kv(engine, f"hit-{length}", len(tokens) + OUT - 1), cache)
    engine.release(f"hit-{length}")


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_worker_then_decode_worker_equals_colocated(whole, chunked, length):
    """The prefill worker (whole) computes the prompt and samples the first token; the decode worker (chunked)
    receives the KV into its reserved blocks and decodes on."""
    tokens = prompt(length, 2)
    logits, cache, out = reference(whole, tokens, f"ref-d{length}")
    prefill, ptap = whole
    first = run(prefill, f"p-{length}", tokens, params(1))
    assert same(ptap.rows[f"p-{length}"], logits[:1])
    sent = prefill.runner.read_blocks(list(prefill.scheduler.kv.get_block_ids(f"p-{length}")))
    prefill.release(f"p-{length}")
    decode, dtap = chunked
    blocks, cached = decode.reserve_remote(f"d-{length}", tokens, params(), hold_blocks=True)
    assert cached == 0
    decode.runner.write_blocks(blocks, sent)
    decode.admit_remote(f"d-{length}", first[0])
    rest = drain(decode)[f"d-{length}"]
    assert first + rest == out
    assert same(dtap.rows[f"d-{length}"], logits[1:])
    assert torch.equal(kv(decode, f"d-{length}", len(tokens) + OUT - 1), cache)
    decode.release(f"d-{length}")


@pytest.mark.parametrize("length", LENGTHS)
def test_kv_pool_load_then_compute_equals_colocated(whole, chunked, length):
    """The full blocks of a prompt computed on one worker (read out as the pool's writer stores them) are loaded
    by another, which computes the rest of the prompt after them."""
    tokens = prompt(length, 3)
    logits, cache, out = reference(whole, tokens, f"ref-p{length}")
    src, _ = whole
    run(src, f"src-{length}", tokens, params(1))
    full = (length - 1) // 16  # at least one prompt token is left to compute
    stored = src.runner.read_blocks(list(src.scheduler.kv.get_block_ids(f"src-{length}"))[:full])
    src.release(f"src-{length}")
    engine, tap = chunked
    reserved = engine.reserve_remote(f"load-{length}", tokens, params(), hold_blocks=True)
    assert reserved is not None and reserved[1] == 0
    engine.load_blocks(f"load-{length}", 0, stored)
    assert drain(engine)[f"load-{length}"] == out
    assert engine.scheduler.requests[f"load-{length}"].num_loaded_tokens == full * 16
    assert same(tap.rows[f"load-{length}"], logits)
    assert torch.equal(kv(engine, f"load-{length}", len(tokens) + OUT - 1), cache)
    engine.release(f"load-{length}")


@pytest.mark.parametrize("length", LENGTHS)
def test_a_moved_request_resumes_from_recomputed_output_as_if_decoded(whole, chunked, length):
    """A request moved after 3 of its 6 tokens: the new worker computes prompt + those 3 as its prompt (by
    prefill, where the first worker decoded them) and samples positions 3.. with output_offset 3."""
    tokens = prompt(length, 4)
    logits, cache, out = reference(whole, tokens, f"ref-m{length}", n=6)
    engine, tap = chunked
    resumed = run(engine, f"moved-{length}", tokens + out[:3], params(3, offset=3))
    assert out[:3] + resumed == out
    assert same(tap.rows[f"moved-{length}"], logits[3:])
    assert torch.equal(kv(engine, f"moved-{length}", len(tokens) + 5), cache)
    engine.release(f"moved-{length}")


@pytest.mark.parametrize("length", [33, 700])
def test_beside_seven_others_equals_alone(whole, chunked, length):
    """Seven other requests of other lengths start with it (on the chunked worker their prefills are cut
    across steps, beside its decodes), plus seven that decode beside the whole worker's run."""
    tokens = prompt(length, 5)
    logits, cache, out = reference(whole, tokens, f"ref-b{length}")
    for (engine, tap), name in ((chunked, "busy"), (whole, "crowd")):
        rid = f"{name}-{length}"
        for j, n in enumerate((5, 40, 130, 300, 17, 64, 450)):
            engine.add_request(f"{rid}-other{j}", prompt(n, 50 + j), params(12, seed=j))
        assert run(engine, rid, tokens, params()) == out
        assert same(tap.rows[rid], logits)
        assert torch.equal(kv(engine, rid, len(tokens) + OUT - 1), cache)
        engine.release(rid)


# -- the kernels ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group, block_size", [(3, 16), (1, 16), (2, 256)])
def test_tiled_attention_rows_are_the_same_decoded_chunked_or_whole(group, block_size):
    torch.manual_seed(0)
    hkv, d, length = 3, 64, 700
    h = hkv * group
    nblocks = 4 + length // block_size
    k_cache, v_cache = torch.randn(nblocks, block_size, hkv, d), torch.randn(nblocks, block_size, hkv, d)
    table = torch.randperm(nblocks)[: -(-length // block_size)]
    q = torch.randn(length, h, d)
    tile, scale = tiled_attention.tile_for(block_size), d ** -0.5
    full = tiled_attention.prefill(q, k_cache, v_cache, table, 0, scale, tile)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_cache[table].reshape(-1, hkv, d)[:length].transpose(0, 1)[None],
        v_cache[table].reshape(-1, hkv, d)[:length].transpose(0, 1)[None], is_causal=True, scale=scale,
        enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(full, ref, atol=2e-6, rtol=1e-5)  # the same attention, summed in another order
    cuts = [0, 1, 2, 255, 256, 300, 511, 513, length]
    parts = [tiled_attention.prefill(q[a:b], k_cache, v_cache, table, a, scale, tile) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert torch.equal(torch.cat(parts), full)
    rows = [0, 1, 15, 16, 255, 256, 257, 400, 699]
    lens = torch.tensor([p + 1 for p in rows])
    width = table.unsqueeze(0).expand(len(rows), -1).clone()
    assert torch.equal(tiled_attention.decode(q[rows], k_cache, v_cache, width, lens, scale, tile), full[rows])
    for p in rows:  # alone, with a table cut to its own length
        own = table[: p // block_size + 1].unsqueeze(0)
        alone = tiled_attention.decode(q[p : p + 1], k_cache, v_cache, own, torch.tensor([p + 1]), scale, tile)
        assert torch.equal(alone[0], full[p]), p


@pytest.mark.parametrize("inner, cols", [(64, 256), (256, 64)])
def test_attention_products_rows_are_the_same_at_every_row_count(inner, cols):
    """The tiled attention's two products (scores: head_dim inner; weighted values: a tile inner), each row
    computed in a product of any number of rows equals the same row in any other. Plain torch.matmul fails this
    on some machines (AVX2: 5-7 and 9-11 rows differ from 4, 8 and 12 or more)."""
    torch.manual_seed(0)
    a, b = torch.randn(600, inner), torch.randn(inner, cols)
    ref = torch.cat([tiled_attention._matmul(a[i : i + 64], b) for i in range(0, 600, 64)])
    for m in [*range(1, 40), 64, 127, 128, 129, 300, 600]:
        assert torch.equal(tiled_attention._matmul(a[:m], b), ref[:m]), m
        assert torch.equal(tiled_attention._matmul(a[600 - m :], b), ref[600 - m :]), m
        batched = tiled_attention._matmul(a[:m].expand(3, 2, m, inner), b.expand(3, 2, inner, cols).contiguous())
        assert torch.equal(batched[2, 1], ref[:m]), m


@pytest.mark.skipif(not packed_linear_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("shape", [(576, 960), (576, 3072), (1536, 576), (576, 49152)])
def test_packed_matmul_rows_are_the_same_at_every_batch_size(shape):
    """SmolLM2's matmul shapes: each row computed alone (as two) equals the same row in a batch of any size."""
    torch.manual_seed(0)
    k, n = shape
    linear = PackedLinear(nn.Linear(k, n, bias=False), min_rows=2)
    x = torch.randn(600, k)
    with torch.inference_mode():
        ref = torch.cat([linear(x[i : i + 64]) for i in range(0, 600, 64)])
        for m in [*range(1, 40), 64, 127, 128, 129, 300, 600]:
            assert torch.equal(linear(x[:m]), ref[:m]), m
            assert torch.equal(linear(x[600 - m :]), ref[600 - m :]), m


def test_a_moe_model_is_batch_invariant_on_the_cpu(random_models):
    """Experts see as many rows as tokens routed to them: their packed matmuls keep each row's result."""
    engine, tap = make(random_models["qwen3_moe"], budget=64, prefix_caching=False)
    tokens = prompt(150, 6)[:150]
    tokens = [t % 384 for t in tokens]
    run(engine, "alone", tokens, params(), hold=False)
    for j in range(7):
        engine.add_request(f"other{j}", [(t * (j + 3)) % 384 for t in tokens[: 20 + 30 * j]], params(8, seed=j))
    run(engine, "crowd", tokens, params(), hold=False)
    assert same(tap.rows["crowd"], tap.rows["alone"])
