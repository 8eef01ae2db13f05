"""Chained block hashes for prefix caching, shared by the engine and the router's global KV index.

A block's hash covers its parent block's hash and its own token ids; the first block's parent is a root
derived from the model id, so two models never share a hash. The hash is a stable 64-bit integer (blake2b),
identical across processes, hosts and Python versions.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


def root_hash(salt: str) -> int:
    """The parent hash of a sequence's first block for the model identified by `salt`."""
    digest = hashlib.blake2b(b"splitserve-kv-root:" + salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], salt: str = "") -> int:
    """Hash of one full block: blake2b(parent hash ‖ token ids as int64 little-endian), 64 bits.

    `parent_hash` is the previous block's hash, or None for the first block (then the model root of
    `salt` is used).
    """
    parent = root_hash(salt) if parent_hash is None else parent_hash
    return _chain(parent, np.asarray(token_ids, dtype="<i8").tobytes())


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, salt: str = "", parent_hash: int | None = None
) -> list[int]:
    """Hashes of every full block of `token_ids` (a trailing partial block gets none): `hash_block_tokens`
    chained, with the token ids converted to bytes once rather than per block."""
    n = len(token_ids) // block_size
    data = np.asarray(token_ids[: n * block_size], dtype="<i8").tobytes()
    width = 8 * block_size
    parent = root_hash(salt) if parent_hash is None else parent_hash
    hashes: list[int] = []
    for i in range(n):
        parent = _chain(parent, data[i * width : (i + 1) * width])
        hashes.append(parent)
    return hashes


def _chain(parent: int, token_bytes: bytes) -> int:
    payload = struct.pack("<Q", parent & _MASK64) + token_bytes
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
