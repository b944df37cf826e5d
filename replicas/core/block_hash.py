"""The prefix-cache hash chain, shared by the block manager and the ingress router.

hash(parent_hash, block_token_ids) over *full* blocks only. Python's hash of a tuple of ints
is deterministic across processes (PYTHONHASHSEED only salts str/bytes), so the router and
every replica compute identical chains in token space.
"""
from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0x9E3779B97F4A7C15  # parent of the first block; any fixed constant works


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, *token_ids))


def block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes
