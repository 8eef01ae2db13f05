"""Block hashes are stable across processes and salted by model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve.common.hashing import hash_block_tokens, hash_token_blocks

pytestmark = pytest.mark.slow


def test_hash_is_identical_in_another_process():
    here = hash_token_blocks(list(range(100)), 16, salt="smollm2")
    code = "from splitserve.engine import hash_token_blocks; print(hash_token_blocks(list(range(100)), 16, salt='smollm2'))"
    env = {"PYTHONHASHSEED": "12345"}
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert out.stdout.strip() == str(here)


def test_chaining_and_salt():
    a = hash_token_blocks([1] * 32, 16, salt="m1")
    assert len(a) == 2 and a[0] != a[1]  # same tokens, different parents
    assert a[1] == hash_block_tokens(a[0], [1] * 16, salt="m1")
    assert hash_token_blocks([1] * 32, 16, salt="m2") != a
    assert hash_token_blocks([1] * 31, 16, salt="m1") == a[:1]  # partial blocks get no hash
