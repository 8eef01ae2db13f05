"""The async face: concurrent streams, abort freeing blocks at once, remote-KV admission."""

from __future__ import annotations

import asyncio

import pytest
from support.helpers import greedy, make_engine

from splitserve.common.text import IncrementalDetokenizer
from splitserve.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def aengine(smollm2_dir):
    eng = AsyncEngine(make_engine(smollm2_dir))
    yield eng
    eng.shutdown()


def test_concurrent_streams_match_offline(aengine):
    tok = aengine.engine.tokenizer
    prompts = [tok.encode(t) for t in ("The quick brown fox", "Once upon a time", "In 1492,")]

    async def one(i, p):
        ids, text = [], ""
        detok = IncrementalDetokenizer(tok, p)
        async for out in aengine.generate(f"s{i}", p, greedy(12, ignore_eos=True)):
            ids += out.new_token_ids
            detok.add_tokens(out.new_token_ids)
            text += detok.delta(out.finished)
        return ids, text

    async def main():
        alone = [await one(f"alone{i}", p) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return alone, together

    alone, together = asyncio.run(main())
    assert together == alone  # batching does not change greedy outputs
    for ids, text in together:
        assert len(ids) == 12
        assert text == tok.decode(ids)


def test_leaving_a_stream_aborts_and_frees_blocks(aengine):
    tok = aengine.engine.tokenizer

    async def main():
        agen = aengine.generate("leave", tok.encode("Count to one hundred:"), greedy(200, ignore_eos=True))
        got = 0
        async for _ in agen:
            got += 1
            if got == 3:
                break
        await agen.aclose()
        for _ in range(100):
            stats = aengine.stats()
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0:
                return stats
            await asyncio.sleep(0.02)
        return aengine.stats()

    stats = asyncio.run(main())
    assert stats["num_running"] == 0
    # blocks return to the pool (still cached for reuse, but unreferenced)
    pool = aengine.engine.scheduler.pool
    assert stats["kv_blocks_used"] == 0 and pool.num_free_blocks == pool.num_blocks


def test_remote_admission_streams_from_given_first_token(aengine):
    """Reserve, then admit with a first token: the stream starts with it and decodes on from there."""
    tok = aengine.engine.tokenizer
    prompt = tok.encode("The capital of France is")

    async def main():
        reserved = await aengine.reserve_remote("remote", prompt, greedy(8, ignore_eos=True))
        assert reserved is not None
        block_ids, _ = reserved
        assert len(block_ids) * 16 >= len(prompt)
        got = []
        async for out in aengine.stream_remote("remote", 42):
            got += out.new_token_ids
        return got

    got = asyncio.run(main())
    assert got[0] == 42 and len(got) == 8
    assert aengine.engine.scheduler.pool.num_used_blocks == 0
