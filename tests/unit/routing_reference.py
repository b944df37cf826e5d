"""Plain models of the router's prefix index and loads: what the fast structures in
`serve_app/routing/` must answer, computed the obvious way (a scan of every replica, a count of
every request in flight). Only the tests use them."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pagedserve.serve_app.routing.cache_mirror import CacheMirror

MAX_IN_FLIGHT = 65536
IN_FLIGHT_TTL_S = 600.0


class CountingLoadTracker:
    """Loads by counting each replica's requests in flight at every call."""

    def __init__(self):
        self._reported: dict[str, float] = {}
        self._report_time: dict[str, float] = {}
        self._finished_since_report: dict[str, int] = {}
        self._in_flight: dict[str, dict[str, float]] = {}  # replica -> request id -> sent at
        self._replica_of: dict[str, str] = {}  # request id -> replica

    def report(self, replica_id: str, queue_depth: float, report_time: float) -> None:
        self._reported[replica_id] = queue_depth
        self._report_time[replica_id] = report_time
        self._finished_since_report[replica_id] = 0

    def sent(self, request_id: str, replica_id: str, now: float) -> str | None:
        """Count request_id against replica_id; returns the replica it was counted on before, if it
        moved (a re-route)."""
        previous = self._replica_of.get(request_id)
        if previous == replica_id:
            return None
        if previous is not None:
            self._in_flight.get(previous, {}).pop(request_id, None)
        self._in_flight.setdefault(replica_id, {})[request_id] = now
        self._replica_of[request_id] = replica_id
        if len(self._replica_of) > MAX_IN_FLIGHT:
            self._drop_older_than(now - IN_FLIGHT_TTL_S)
        return previous

    def completed(self, request_id: str) -> None:
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is None:
            return
        sent_at = self._in_flight.get(replica_id, {}).pop(request_id, None)
        report_time = self._report_time.get(replica_id)
        if sent_at is not None and report_time is not None and sent_at <= report_time:
            self._finished_since_report[replica_id] += 1  # it was in the report's count

    def load(self, replica_id: str) -> float:
        reported = max(0.0, self._reported.get(replica_id, 0.0)
                       - self._finished_since_report.get(replica_id, 0))
        return reported + self.num_sent_since_report(replica_id)

    def num_sent_since_report(self, replica_id: str) -> int:
        report_time = self._report_time.get(replica_id, float("-inf"))
        return sum(1 for at in self._in_flight.get(replica_id, {}).values() if at > report_time)

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        live = set(live_replica_ids)
        for replica_id in [r for r in self._in_flight if r not in live]:
            for request_id in self._in_flight.pop(replica_id):
                self._replica_of.pop(request_id, None)
        for table in (self._reported, self._report_time, self._finished_since_report):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    def _drop_older_than(self, horizon: float) -> None:
        for replica_id, requests in self._in_flight.items():
            for request_id in [r for r, at in requests.items() if at < horizon]:
                del requests[request_id]
                self._replica_of.pop(request_id, None)


class ScanPrefixIndex:
    """Matches by scanning every replica's mirrored and optimistic blocks, block by block."""

    def __init__(self, optimistic_ttl_s: float = 10.0):
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
