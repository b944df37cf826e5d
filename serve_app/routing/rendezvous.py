"""Rendezvous (highest-random-weight) hashing over the live replicas, and the replica set a
decision ranks: sorted ids, their positions, and their hash seeds, built once per change of the set.

A replica's weight for a key is `mix64(mix64(key) ^ seed(replica))`, where `mix64` is SplitMix64's
finalizer and the seed is a blake2b digest of the replica id: stable across processes (Python's
str hash is salted), and cheap enough to weigh every replica for every cold prefix. One blake2b per
replica and key (the weight before) made a decision at a thousand replicas slow; the seeds are
computed once per replica, and the mix runs over all of them at once in numpy.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import repeat

import numpy as np

MASK64 = (1 << 64) - 1
KEPT_WEIGHTS_BYTES = 2 << 20  # per replica set: 256 keys' weights at 1,000 replicas
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(z: int) -> int:
    """SplitMix64's finalizer on a 64-bit unsigned int."""
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_U1, _U2 = np.uint64(_M1), np.uint64(_M2)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """mix64 over an array, in place (uint64 arrays wrap on overflow, as & MASK64 does)."""
    t = z >> _S30
    z ^= t
    z *= _U1
    np.right_shift(z, _S27, out=t)
    z ^= t
    z *= _U2
    np.right_shift(z, _S31, out=t)
    z ^= t
    return z


@lru_cache(maxsize=1 << 16)
def replica_seed(replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "little")


def rendezvous_weight(key: int, replica_id: str) -> int:
    return mix64(mix64(key & MASK64) ^ replica_seed(replica_id))


def rendezvous_home(key: int, replica_ids: Sequence[str]) -> str:
    return max(replica_ids, key=lambda r: rendezvous_weight(key, r))


class ReplicaSet:
    """The live replicas, in sorted order (every router ranks them alike)."""

    __slots__ = ("key", "ids", "ids_set", "position", "loads", "_seeds", "_kept", "_keep")

    def __init__(self, replica_ids: Iterable[str], loads: Mapping[str, float] | None = None):
        self.key = tuple(replica_ids)  # as given: what the next call is compared with
        self.ids = tuple(sorted(self.key))
        self.ids_set = frozenset(self.ids)
        self.position = {r: i for i, r in enumerate(self.ids)}
        self._seeds = np.fromiter(map(replica_seed, self.ids), dtype=np.uint64, count=len(self.ids))
        # Each replica's load, in `ids` order; whoever owns the set keeps it current.
        self.loads = np.fromiter(map((loads or {}).get, self.ids, repeat(0.0)), dtype=np.float64,
                                 count=len(self.ids))
        self._kept: dict[int, np.ndarray] = {}  # key -> weights (kept_weights), oldest first
        self._keep = max(16, KEPT_WEIGHTS_BYTES // (8 * max(1, len(self.ids))))

    def set_load(self, replica_id: str, load: float) -> None:
        position = self.position.get(replica_id)
        if position is not None:
            self.loads[position] = load

    def __len__(self) -> int:
        return len(self.ids)

    def weight(self, key: int, position: int) -> int:
        """rendezvous_weight(key, ids[position])."""
        return mix64(mix64(key & MASK64) ^ int(self._seeds[position]))

    def weights(self, key: int) -> np.ndarray:
        """Every replica's rendezvous weight for key, in `ids` order."""
        return _mix64_array(self._seeds ^ np.uint64(mix64(key & MASK64)))

    def kept_weights(self, key: int) -> np.ndarray:
        """weights(key), read-only, kept for the next decision with the same key: a hot prompt
        sent past its busy holders weighs the least-loaded replicas on its first block, request
        after request (a dozen whole-array passes each, slow with cold caches)."""
        weights = self._kept.get(key)
        if weights is None:
            if len(self._kept) >= self._keep:
                del self._kept[next(iter(self._kept))]
            weights = self._kept[key] = self.weights(key)
            weights.flags.writeable = False
        return weights
