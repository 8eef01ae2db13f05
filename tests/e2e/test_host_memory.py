"""A CPU worker bounds oneDNN's per-shape cache and glibc's mmap threshold before its first step, unless its
operator set them (engine/host_memory.py; the soak in benchmarks/soak.py measures the effect)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROBE = ("import os; from splitserve.engine.host_memory import bound_host_memory; bound_host_memory(); "
         "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])")


def probe(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "MALLOC_MMAP_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_worker_bounds_onednn_s_cache() -> None:
    from splitserve.engine.host_memory import ONEDNN_CACHE_CAPACITY

    assert probe() == str(ONEDNN_CACHE_CAPACITY)


def test_an_operator_s_setting_wins() -> None:
    assert probe(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", MALLOC_MMAP_THRESHOLD_="1048576") == "1024"
