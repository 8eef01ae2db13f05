"""The engine's disaggregation hooks, in process: layer-written notifications on the prefill side, and a
decode engine that admits a prompt whose KV was copied into blocks it reserved."""

from __future__ import annotations

import torch
from support.helpers import greedy, make_engine


class RecordingHook:
    def __init__(self, wants_layers: bool = True) -> None:
        self.calls: list = []
        self.wants_layers = wants_layers

    def on_step_begin(self, scheduled) -> bool:
        self.calls.append(("begin", [(s.request_id, s.start, s.num_new_tokens) for s in scheduled]))
        return self.wants_layers

    def on_layer_written(self, layer_idx: int) -> None:
        self.calls.append(("layer", layer_idx))

    def on_step_end(self, scheduled) -> None:
        self.calls.append(("end",))


def test_every_hook_sees_every_step_and_layers_only_when_it_asks(smollm2_dir):
    """The hook point takes any number of consumers; one that declines a step's layers sees only its ends."""
    engine = make_engine(smollm2_dir, budget=32)
    layered, quiet = RecordingHook(), RecordingHook(wants_layers=False)
    engine.add_layer_hook(layered)
    engine.add_layer_hook(quiet)
    engine.generate([engine.tokenizer.encode("word " * 50)], greedy(2))
    steps = [c for c in layered.calls if c[0] == "begin"]
    assert steps == [c for c in quiet.calls if c[0] == "begin"] and len(steps) >= 3
    assert sum(c[0] == "end" for c in quiet.calls) == len(steps)
    assert not any(c[0] == "layer" for c in quiet.calls)
    assert sum(c[0] == "layer" for c in layered.calls) == len(steps) * engine.arch.num_layers


def test_layer_hook_fires_once_per_layer_in_order(smollm2_dir):
    engine = make_engine(smollm2_dir, budget=32)
    hook = RecordingHook()
    engine.add_layer_hook(hook)
    prompt = engine.tokenizer.encode("word " * 50)
    engine.generate([prompt], greedy(1))
    steps = [i for i, c in enumerate(hook.calls) if c[0] == "begin"]
    assert len(steps) == -(-len(prompt) // 32)  # one step per 32-token chunk
    for i in steps:
        layers = [c[1] for c in hook.calls[i + 1 : i + 31]]
        assert layers == list(range(30)) and hook.calls[i + 31] == ("end",)


def test_imported_kv_decodes_exactly_like_local(smollm2_dir):
    src = make_engine(smollm2_dir)
    dst = make_engine(smollm2_dir, prefix_caching=False)
    prompt = src.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}])
    ref = src.generate([prompt], greedy(12, ignore_eos=True))[0]["token_ids"]

    req = src.add_request("p", prompt, greedy(1), hold_blocks=True)
    while src.has_unfinished():
        src.step()
    src_blocks = src.scheduler.kv.get_block_ids("p")
    assert src_blocks and src.scheduler.pool.num_used_blocks == len(src_blocks)  # held after finishing

    dst_blocks, cached = dst.reserve_remote("d", prompt, greedy(12, ignore_eos=True))
    assert cached == 0 and len(dst_blocks) == len(src_blocks)
    with torch.no_grad():
        for (sk, sv), (dk, dv) in zip(src.runner.kv_caches, dst.runner.kv_caches, strict=True):
            dk[dst_blocks] = sk[src_blocks]
            dv[dst_blocks] = sv[src_blocks]
    assert src.release("p") and src.scheduler.pool.num_used_blocks == 0

    tokens = dst.admit_remote("d", req.output_token_ids[0]).new_token_ids
    while dst.has_unfinished():
        for out in dst.step():
            tokens += out.new_token_ids
    assert tokens == ref
    assert dst.scheduler.pool.num_used_blocks == 0
