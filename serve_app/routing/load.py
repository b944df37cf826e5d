"""A replica's load as the router sees it: its last reported queue depth (waiting + running), less
the requests this router has seen finish since that report, plus those it sent since.

Reports arrive about once a second. Routed on the report alone, a burst would all land on whichever
replica looked idle; and a report that still counts requests which have since finished would push
work away from a replica that is in fact free. Report times are the replica's wall clock, compared
with ours (same host, or NTP-close: milliseconds against a one-second period). Pure Python.
"""
from __future__ import annotations

from collections.abc import Iterable

MAX_IN_FLIGHT = 65536  # past this, requests never seen finishing (cancelled) are dropped
IN_FLIGHT_TTL_S = 600.0


class LoadTracker:
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
