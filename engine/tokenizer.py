"""Tokenizer wrapper: encode, chat template, incremental detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        eos = set()
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        gen_cfg = Path(model_dir) / "generation_config.json"
        if gen_cfg.is_file():
            import json

            e = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos.update(e if isinstance(e, list) else ([e] if e is not None else []))
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def maybe(cls, model_dir: str | Path) -> Tokenizer | None:
        d = Path(model_dir)
        if (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file():
            return cls(d)
        return None

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Holds back text that ends in an incomplete UTF-8 sequence, and text that could be the beginning of a
    stop string, so no broken character or partial stop string reaches the client.
    """

    CONTEXT = 5  # prompt tokens decoded with the output so leading spaces come out right

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop: bool = False) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = list(stop)
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all decoded output text (up to a matched stop string)
        self.emitted = 0  # characters of `text` already returned

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def check_stop(self, new_chars: int) -> str | None:
        """If a stop string now appears, cut the text there and return it."""
        if not self.stop:
            return None
        start = max(0, len(self.text) - new_chars - self.hold)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def delta(self, finished: bool) -> str:
        """New text safe to show now (everything, once finished)."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
