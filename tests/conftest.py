"""Shared fixtures: the real SmolLM2 weights, small random-weight models saved by Hugging Face, and a KV transfer
agent receiving for each backend (TCP and NIXL)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from support.models import make_random_model

pytest_plugins = ["support.schedule"]

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that wait sleep instead of spinning (set before torch loads; the clusters the tests start
# inherit it): on a shared 2-core box a spinning thread takes the core its partner needs, and a step takes
# several times as long. Only the waiting changes, not the arithmetic.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`'s two processes end with the pytest that started them
    from splitserve.common.proc import die_with

    die_with(os.getppid())


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C on `make test` stops it at once: pytest-xdist's own shutdown waits for each process's module to end.
    Its processes end with it (above), and the clusters they started with them."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        signal.signal(signal.SIGINT, _stop_now)


def _stop_now(signum: int, frame: object) -> None:
    sys.stderr.write("\ninterrupted: the test processes and their clusters stop\n")
    os._exit(130)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from splitserve.engine.model_files import prepare_model

    return prepare_model("smollm2")


@pytest.fixture(scope="session")
def random_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {k: make_random_model(k, root / k) for k in ("qwen3", "qwen3_moe", "mixtral", "llama3", "qwen2")}


def _nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=["tcp", "nixl"])
def backend(request):
    """A KV transfer backend's name; NIXL missing fails the test (`make test` installs it)."""
    if request.param == "nixl" and not _nixl_available():
        pytest.fail("NIXL is not installed: `make test` installs it (nixl + nixl-cu13 wheels)")
    return request.param


@pytest.fixture
def receiver(backend):
    """A transfer agent of `backend` in this process, over an empty KV cache of tests/support/kv_peer.py's shape."""
    from support.kv_peer import make_kv

    from splitserve.kv_transfer import KVLayout, make_agent

    agent = make_agent(backend, KVLayout(make_kv(0, fill=False)))
    assert agent.backend.name == backend
    yield agent
    agent.close()
