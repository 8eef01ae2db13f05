"""Text in and out of token ids: the tokenizer (`tokenizer.json` through the `tokenizers` library, chat templates
through a sandboxed Jinja environment) and the incremental detokenizer that owns stop strings.

No torch and no transformers: the gateway loads this in well under a second. Chat templates render as Hugging
Face renders them (trim_blocks, lstrip_blocks, `tojson` without HTML escaping, `raise_exception`,
`strftime_now`, the special tokens as variables), so prompts are token-identical to transformers'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """A model directory's tokenizer: `tokenizer.json`, `tokenizer_config.json` and its chat template."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as _Backend

        d = Path(model_dir)
        self.backend = _Backend.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.special: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(cfg.get(name))
            if text is not None:
                self.special[name] = text
        self.clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self._compiled = None
        eos: set[int] = set()
        if "eos_token" in self.special and (tid := self.backend.token_to_id(self.special["eos_token"])) is not None:
            eos.add(tid)
        gen_cfg = d / "generation_config.json"
        if gen_cfg.is_file():
            e = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos.update(e if isinstance(e, list) else ([e] if e is not None else []))
        self.eos_token_ids = frozenset(eos)
        self._added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        self._byte_level = type(self.backend.decoder).__name__ == "ByteLevel"

    @classmethod
    def maybe(cls, model_dir: str | Path) -> Tokenizer | None:
        return cls(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The chat template applied to `messages`, ending with the assistant's generation prompt."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        if self._compiled is None:
            self._compiled = _chat_environment().from_string(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=True, **self.special)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=True)
        return _clean_up(text) if self.clean_up_spaces else text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (part of a UTF-8 character for some tokens), not its decoded text.

        Byte-level BPE vocabularies map each byte to a printable stand-in character (GPT-2's table);
        SentencePiece vocabularies spell raw bytes as `<0xAB>` and spaces as `▁`.
        """
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self._added:
            return piece.encode()
        if self._byte_level:
            table = _byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization`: no space before punctuation and common contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in character -> byte."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    return _BYTE_DECODER


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; the one owner of stop strings.

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
        self.stop_reason: str | None = None

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Add tokens; returns the stop string if one now appears (the text is cut there)."""
        before = len(self.text)
        for t in token_ids:
            self.add(t)
        return self.check_stop(len(self.text) - before)

    def check_stop(self, new_chars: int) -> str | None:
        """If a stop string now appears, cut the text there and return it."""
        if not self.stop or self.stop_reason is not None:
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
        self.stop_reason = s
        return s

    def delta(self, finished: bool) -> str:
        """New text safe to show now (everything, once finished)."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
