"""A replica's load as the router sees it: its last reported queue depth plus what this router sent
it since that report and has not seen finish.

Reports arrive about once a second; a burst routed on the report alone would all land on whichever
replica looked idle. Requests sent before the report are already in its count (or done), so they
are dropped when a newer report arrives; that also bounds the bookkeeping to about one report
period of requests. Report times are the replica's wall clock, compared with ours (same host, or
NTP-close: milliseconds against a one-second period). Pure Python.
"""
from __future__ import annotations

from collections.abc import Iterable


class LoadTracker:
    def __init__(self):
        self._reported: dict[str, float] = {}
        self._report_time: dict[str, float] = {}
        self._sent: dict[str, dict[str, float]] = {}  # replica -> request id -> sent at
        self._replica_of: dict[str, str] = {}  # request id -> replica

    def report(self, replica_id: str, queue_depth: float, report_time: float) -> None:
        self._reported[replica_id] = queue_depth
        self._report_time[replica_id] = report_time
        sent = self._sent.get(replica_id)
        if sent:
            for request_id in [r for r, at in sent.items() if at <= report_time]:
                del sent[request_id]
                self._replica_of.pop(request_id, None)

    def sent(self, request_id: str, replica_id: str, now: float) -> str | None:
        """Count request_id against replica_id; returns the replica it was counted on before, if it
        moved (a re-route)."""
        previous = self._replica_of.get(request_id)
        if previous == replica_id:
            return None
        if previous is not None:
            self._sent.get(previous, {}).pop(request_id, None)
        self._sent.setdefault(replica_id, {})[request_id] = now
        self._replica_of[request_id] = replica_id
        return previous

    def completed(self, request_id: str) -> None:
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is not None:
            self._sent.get(replica_id, {}).pop(request_id, None)

    def load(self, replica_id: str) -> float:
        return self._reported.get(replica_id, 0.0) + len(self._sent.get(replica_id, ()))

    def reported(self, replica_id: str) -> float:
        return self._reported.get(replica_id, 0.0)

    def num_sent_since_report(self, replica_id: str) -> int:
        return len(self._sent.get(replica_id, ()))

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        live = set(live_replica_ids)
        for replica_id in [r for r in self._sent if r not in live]:
            for request_id in self._sent.pop(replica_id):
                self._replica_of.pop(request_id, None)
        for table in (self._reported, self._report_time):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]
