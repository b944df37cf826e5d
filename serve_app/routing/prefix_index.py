"""Which replica holds which prefix: block hash -> replicas, in the replicas' own token space.

Fed two ways. Each replica's digest (about once a second) carries its KV-cache events, which a
`CacheMirror` per replica applies: that is what the replica holds, exactly. Between digests, the
router inserts a request's block hashes optimistically for the replica it sends the request to:
that replica will hold them once it prefills, and the next request with the same prefix must find
them before the next digest says so. An optimistic entry lives until a digest taken
`optimistic_ttl_s` after the insert has had time to show it (or to show that it was evicted again).

Hashes are chained (`replicas.block_hash`), so one hash names a whole prefix; a match is the number
of leading blocks of a request that a replica holds. Pure Python.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from serve_app.routing.cache_mirror import CacheMirror

DEFAULT_OPTIMISTIC_TTL_S = 10.0


class PrefixIndex:
    def __init__(self, optimistic_ttl_s: float = DEFAULT_OPTIMISTIC_TTL_S):
        self.optimistic_ttl_s = optimistic_ttl_s
        self._mirrors: dict[str, CacheMirror] = {}  # replica -> what its event stream says it holds
        self._optimistic: dict[str, dict[int, float]] = {}  # replica -> hash -> inserted at
        self._report_time: dict[str, float] = {}

    @property
    def replica_ids(self) -> set[str]:
        return set(self._mirrors) | set(self._optimistic)

    def report_time(self, replica_id: str) -> float | None:
        return self._report_time.get(replica_id)

    def in_sync(self, replica_id: str) -> bool:
        """Whether what we know of replica_id's cache is exact (see CacheMirror)."""
        mirror = self._mirrors.get(replica_id)
        return mirror is not None and mirror.in_sync

    def observe(self, replica_id: str, kv_events: Mapping[str, Any] | None,
                report_time: float) -> None:
        """Apply replica_id's digest taken at report_time: its KV event stream, if it caches."""
        mirror = self._mirrors.setdefault(replica_id, CacheMirror())
        if kv_events is not None:
            mirror.apply(kv_events)
        self._report_time[replica_id] = report_time
        optimistic = self._optimistic.get(replica_id)
        if optimistic:
            horizon = report_time - self.optimistic_ttl_s
            for block_hash in [h for h, at in optimistic.items() if at <= horizon]:
                del optimistic[block_hash]

    def insert(self, replica_id: str, block_hashes: Iterable[int], now: float) -> None:
        """Optimistically record that replica_id is about to hold these blocks."""
        optimistic = self._optimistic.setdefault(replica_id, {})
        for block_hash in block_hashes:
            optimistic[block_hash] = now

    def remove(self, replica_id: str, block_hashes: Iterable[int], inserted_at: float) -> None:
        """Take back an optimistic insert made at inserted_at (the request went elsewhere); hashes
        inserted again since, for another request, stay."""
        optimistic = self._optimistic.get(replica_id)
        if optimistic:
            for block_hash in block_hashes:
                if optimistic.get(block_hash) == inserted_at:
                    del optimistic[block_hash]

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone."""
        live = set(live_replica_ids)
        for table in (self._mirrors, self._optimistic, self._report_time):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    def holds(self, replica_id: str, block_hash: int) -> bool:
        return (block_hash in self._confirmed(replica_id)
                or block_hash in self._optimistic.get(replica_id, ()))

    def holders(self, block_hash: int) -> set[str]:
        return {r for r in self.replica_ids if self.holds(r, block_hash)}

    def match(self, block_hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """For each replica: how many leading blocks of the request it holds."""
        matches = {}
        for replica_id in replica_ids:
            confirmed = self._confirmed(replica_id)
            optimistic = self._optimistic.get(replica_id, ())
            num = 0
            for block_hash in block_hashes:
                if block_hash not in confirmed and block_hash not in optimistic:
                    break
                num += 1
            matches[replica_id] = num
        return matches

    def num_blocks(self, replica_id: str) -> int:
        return len(self._confirmed(replica_id) | set(self._optimistic.get(replica_id, ())))

    def _confirmed(self, replica_id: str) -> set[int] | tuple[()]:
        mirror = self._mirrors.get(replica_id)
        return mirror.block_hashes if mirror is not None else ()
