"""Shared fixtures: the real SmolLM2 weights and small random-weight models saved by Hugging Face."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.models import make_random_model

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from splitserve.engine.model_files import prepare_model

    return prepare_model("smollm2")


@pytest.fixture(scope="session")
def random_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {k: make_random_model(k, root / k) for k in ("qwen3", "qwen3_moe", "mixtral", "llama3", "qwen2")}
