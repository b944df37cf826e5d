"""A replica's load as the router sees it: its last reported queue depth (waiting + running), less
the requests this router has seen finish since that report was taken, plus those it sent since.
A report reaches the router late (Ray's stats period and propagation); the requests it counted that
finished in between are remembered, by when they finished, and taken off when it arrives. Counted
from its arrival instead, each of them stayed a phantom load until the next report, and two
choices between loads that noisy placed prompts worse than the plain in-flight count of Ray's own
router did.

Reports arrive about once a second. Routed on the report alone, a burst would all land on whichever
replica looked idle; and a report that still counts requests which have since finished would push
work away from a replica that is in fact free. Report times are the replica's wall clock, compared
with ours (same host, or NTP-close: milliseconds against a one-second period).

With several ingress replicas, each router sees only its own sends between reports; each of them
counts as many requests as all routers send for each of its own, its share of the replicas'
reported arrivals (`send_weight`). That guess is right on average but noisy (a few sends a
second, each counting several times: a replica's load jumped by the weight at every send and every
end, and the least of many such loads read far too low), so reports also come far more often
than digests: every engine step whose outputs reach this ingress on a core's connection carries
the replica's queue depth and arrivals (`pagedserve.serve_app.engine_client`), and its finished requests end
here first, as of that report. Whichever report is newest counts; an older one that arrives late
is ignored.

Every load is kept current as it changes (`loads`), so a decision reads each replica's load in
O(1) instead of counting its in-flight requests: at 1,000 replicas of 256 requests each, counting
was most of the router's time.

Beside the load, the prompt blocks queued for prefill on each replica (`queued_prefill`): a new
prompt's time to first token is the prefill queued ahead of it, which the request count, mostly
decoding requests, does not show. This router counts its own requests' blocks that their replica
was not expected to hold, from the send until the first output (or the end: a non-streamed
request's first output is its last). Where other ingresses send too (a send weight above 1),
that count misses theirs, and a step report's replaces it (everyone's, plus this router's sends
since); alone, this router's own count is the better one, since it knows each prompt's expected
cache hit, which the replica learns only when it admits the prompt (in bench.fleet's llm-d day it
needs fewer replica-seconds than the replica's count).
Pure Python.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

MAX_IN_FLIGHT = 65536  # past this, requests never seen finishing (cancelled) are dropped
IN_FLIGHT_TTL_S = 600.0
MAX_RECENT_FINISHES = 4096  # per replica, kept for the next report (a few seconds' worth)
_NEVER = float("-inf")
# The reports of each replica over which a router's share of its arrivals is measured; the
# arrivals over them (summed over the replicas) below which the share is too noisy to weigh its
# sends by; and the most one send may weigh (a router that sent nothing lately has no share to
# speak of).
WEIGHING_REPORTS = 5
MIN_WEIGHING_ARRIVALS = 64
MAX_SEND_WEIGHT = 64.0
# Step reports come every few milliseconds: the share is measured over reports at least this far
# apart, so that its window spans seconds (digests, a second apart, all count).
WEIGHING_SPACING_S = 0.5


class LoadTracker:
    def __init__(self, listener: Callable[[str, float], None] | None = None):
        self.loads: dict[str, float] = {}  # replica -> load(replica), kept current on every change
        self.listener = listener  # listener(replica, load) on every change, 0.0 once forgotten
        self._reported: dict[str, float] = {}
        self._report_time: dict[str, float] = {}
        self._finished_since_report: dict[str, int] = {}
        self._sent_since_report: dict[str, int] = {}
        # replica -> (finished at, sent at) of requests seen finishing after its last report
        self._recent_finishes: dict[str, deque[tuple[float, float]]] = {}
        self._in_flight: dict[str, dict[str, float]] = {}  # replica -> request id -> sent at
        # request id -> replica, oldest send first: the TTL pops from the front.
        self._replica_of: OrderedDict[str, str] = OrderedDict()
        # replica -> prompt blocks of the requests sent there whose first output has not come
        # (their prefill is queued or under way); request id -> its blocks in that count.
        self.queued_prefill: dict[str, int] = {}
        self._queued_blocks: dict[str, int] = {}
        # Requests all routers send for each this one sends (see `_weigh_sends`), and what it is
        # estimated from: replica -> this router's sends there, ever; replica -> (its sends, the
        # replica's arrivals, the report's time) at its last reports, and their growth over those.
        self.send_weight = 1.0
        self._num_sent: dict[str, int] = {}
        self._arrivals_at_report: dict[str, deque[tuple[int, int, float]]] = {}
        self._interval: dict[str, tuple[int, int]] = {}
        self._interval_sums = [0, 0]  # the intervals' growths summed over the replicas

    def report(self, replica_id: str, queue_depth: float, report_time: float,
               num_arrived: int | None = None, queued_prefill_blocks: int | None = None) -> None:
        """num_arrived: the requests the replica ever received, from every router;
        queued_prefill_blocks: the prompt blocks it had still to prefill, everyone's (None: not
        reported; it counts only where other ingresses send too). A report no newer than the last
        one applied is ignored."""
        if report_time <= self._report_time.get(replica_id, _NEVER):
            return
        self._reported[replica_id] = queue_depth
        self._report_time[replica_id] = report_time
        recent = self._recent_finishes.get(replica_id)
        while recent and recent[0][0] <= report_time:  # the report saw them gone
            recent.popleft()
        # Those it counted (sent before it) but that finished after it was taken.
        self._finished_since_report[replica_id] = (sum(sent_at <= report_time
                                                       for _, sent_at in recent) if recent else 0)
        in_flight = self._in_flight.get(replica_id)
        # Once per report, not per decision: which of the requests in flight the report predates.
        # Sends are kept in the order they were made, so the newest come last.
        sent_since = queued_since = 0
        if in_flight:
            queued_blocks = self._queued_blocks
            for request_id, sent_at in reversed(in_flight.items()):
                if sent_at <= report_time:
                    break
                sent_since += 1
                queued_since += queued_blocks.get(request_id, 0)
        self._sent_since_report[replica_id] = sent_since
        if queued_prefill_blocks is not None and self.send_weight > 1.0:
            # Other ingresses send too: the report's count (everyone's), and ours since.
            self.queued_prefill[replica_id] = queued_prefill_blocks + queued_since
        if num_arrived is not None:
            # Ours that reached it by the report: less those sent since, in flight or finished
            # (the finishes since it that it did not count).
            sent_and_finished = (len(recent) - self._finished_since_report[replica_id]
                                 if recent else 0)
            own = (self._num_sent.get(replica_id, 0) - self._sent_since_report[replica_id]
                   - sent_and_finished)
            self._weigh_sends(replica_id, own, int(num_arrived), report_time)
        self._update(replica_id)

    def sent(self, request_id: str, replica_id: str, now: float,
             prefill_blocks: int = 0) -> str | None:
        """Count request_id against replica_id, and its `prefill_blocks` (the prompt blocks the
        replica is not expected to hold) as queued there until `prefilled`; returns the replica it
        was counted on before, if it moved (a re-route)."""
        previous = self._replica_of.get(request_id)
        if previous == replica_id:
            return None
        if previous is not None:  # it never reached that replica
            self.unsent(request_id)
        if prefill_blocks > 0:
            self._queued_blocks[request_id] = prefill_blocks
            queued = self.queued_prefill
            queued[replica_id] = queued.get(replica_id, 0) + prefill_blocks
        self._in_flight.setdefault(replica_id, {})[request_id] = now
        self._replica_of[request_id] = replica_id
        self._num_sent[replica_id] = self._num_sent.get(replica_id, 0) + 1
        if now > self._report_time.get(replica_id, _NEVER):
            self._sent_since_report[replica_id] = self._sent_since_report.get(replica_id, 0) + 1
            self._update(replica_id)
        if len(self._replica_of) > MAX_IN_FLIGHT:
            self._drop_older_than(now - IN_FLIGHT_TTL_S)
        return previous

    def prefilled(self, request_id: str) -> None:
        """request_id's first output came: its prompt is no longer queued for prefill."""
        blocks = self._queued_blocks.pop(request_id, None)
        if blocks is not None:
            queued, replica_id = self.queued_prefill, self._replica_of[request_id]
            # A report's count may have left it out already (it had prefilled by then).
            queued[replica_id] = max(0, queued[replica_id] - blocks)

    def unsent(self, request_id: str) -> None:
        """request_id never reached the replica it was counted on (it refused it): as if never
        sent there."""
        replica_id = self._replica_of.get(request_id)
        if replica_id is not None:
            self._forget(request_id, replica_id, finished=False)
            self._num_sent[replica_id] -= 1

    def completed(self, request_id: str, now: float | None = None) -> None:
        """request_id finished at `now` (None: when is unknown, so no later-arriving report
        taken before it is corrected for it)."""
        replica_id = self._replica_of.get(request_id)
        if replica_id is not None:
            sent_at = self._forget(request_id, replica_id, finished=True)
            if now is not None:
                recent = self._recent_finishes.get(replica_id)
                if recent is None:
                    recent = self._recent_finishes[replica_id] = deque(maxlen=MAX_RECENT_FINISHES)
                recent.append((now, sent_at))

    def load(self, replica_id: str) -> float:
        return self.loads.get(replica_id, 0.0)

    def num_sent_since_report(self, replica_id: str) -> int:
        return self._sent_since_report.get(replica_id, 0)

    def retain(self, live_replica_ids: Iterable[str]) -> None:
        live = set(live_replica_ids)
        for replica_id in [r for r in self._in_flight if r not in live]:
            for request_id in self._in_flight.pop(replica_id):
                self._replica_of.pop(request_id, None)
                self._queued_blocks.pop(request_id, None)
        for replica_id in [r for r in self.loads if r not in live]:
            if self.listener is not None:
                self.listener(replica_id, 0.0)
        for replica_id in [r for r in self._interval if r not in live]:
            self._add_interval(replica_id, None)
        for table in (self._reported, self._report_time, self._finished_since_report,
                      self._sent_since_report, self._recent_finishes, self.loads,
                      self.queued_prefill, self._num_sent, self._arrivals_at_report):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    def _forget(self, request_id: str, replica_id: str, finished: bool) -> float:
        self.prefilled(request_id)
        del self._replica_of[request_id]
        sent_at = self._in_flight[replica_id].pop(request_id)
        report_time = self._report_time.get(replica_id)
        if report_time is None or sent_at > report_time:
            self._sent_since_report[replica_id] -= 1
        elif finished:
            self._finished_since_report[replica_id] += 1  # it was in the report's count
        self._update(replica_id)
        return sent_at

    def _weigh_sends(self, replica_id: str, own: int, num_arrived: int,
                     report_time: float) -> None:
        """Several routers (one per ingress replica) send to the same replicas, and each sees
        only its own sends between reports. A replica's report counts everyone's requests, so
        this router's share of the arrivals, over each replica's last few reports, says how
        many requests all routers send for each of its own: its sends since a report count that
        many times. Counted once, a hot prefix's holders looked idle to every ingress at once
        between reports, and all of them piled onto it (bench.fleet --ingresses). `own`: this
        router's sends that reached the replica by its report, `num_arrived` everyone's."""
        history = self._arrivals_at_report.get(replica_id)
        if history is None or num_arrived < history[-1][1]:  # the first report, or a restart
            history = self._arrivals_at_report[replica_id] = deque(maxlen=WEIGHING_REPORTS)
            self._add_interval(replica_id, None)
        elif report_time - history[-1][2] < WEIGHING_SPACING_S:
            return
        history.append((own, num_arrived, report_time))
        if len(history) < 2:
            return
        self._add_interval(replica_id, (own - history[0][0], num_arrived - history[0][1]))
        sent, arrived = self._interval_sums
        if arrived >= MIN_WEIGHING_ARRIVALS:
            self.send_weight = min(MAX_SEND_WEIGHT, max(1.0, arrived / max(sent, 1)))

    def _add_interval(self, replica_id: str, growth: tuple[int, int] | None) -> None:
        """replica_id's growth (our sends there and its arrivals) over its last reports is now
        `growth` (None: it is gone), in `_interval_sums` too."""
        sums = self._interval_sums
        old = self._interval.pop(replica_id, None)
        if old is not None:
            sums[0] -= old[0]
            sums[1] -= old[1]
        if growth is not None:
            self._interval[replica_id] = growth
            sums[0] += growth[0]
            sums[1] += growth[1]

    def _update(self, replica_id: str) -> None:
        w = self.send_weight
        reported = max(0.0, self._reported.get(replica_id, 0.0)
                       - w * self._finished_since_report.get(replica_id, 0))
        load = self.loads[replica_id] = reported + w * self._sent_since_report.get(replica_id, 0)
        if self.listener is not None:
            self.listener(replica_id, load)

    def _drop_older_than(self, horizon: float) -> None:
        while self._replica_of:
            request_id, replica_id = next(iter(self._replica_of.items()))
            if self._in_flight[replica_id][request_id] >= horizon:
                return
            self._forget(request_id, replica_id, finished=False)
