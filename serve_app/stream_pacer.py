"""StreamPacer: one ingress replica's budget of server-sent events, shared by its open streams.

Every event costs the ingress a socket write (and, through Ray Serve's proxy, a Ray message each
to the proxy and from it: a fixed CPU cost, whatever the event holds), so with many streams the
serving path, not the engine, could set the pace. A stream whose
previous event left less than `open streams / events_per_s` ago (and never more than
`max_delay_s`) waits out the rest, then sends everything that piled up as one event; a lone
stream, or one slower than its share, never waits.

The budget is measured, not guessed (unless `events_per_s` is given): in each window where it
is not holding streams back (one in PROBE_EVERY while it does), this process's CPU time per event
sent, and the events per second that keep it at `cpu_share` of a core. It holds streams back only
while the ingress really uses that share (and until it falls below RELEASE of it): below,
waiting would add latency and save nothing. A fast machine gets a large budget, a small one a
tight one; an idle ingress keeps its last estimate.
"""
from __future__ import annotations

import time
from collections.abc import Callable

INITIAL_EVENTS_PER_S = 4000.0  # until the first window has measured the cost
MIN_EVENTS_PER_S = 100.0
MAX_EVENTS_PER_S = 100_000.0
CPU_SHARE = 0.5  # of one core, for this ingress replica's streams
RELEASE = 0.8  # pacing, once on, stays on until the ingress uses less than this much of its share
# The longest a stream ever waits (the default): under it a reader sees a steady stream.
MAX_DELAY_S = 0.02
WINDOW_S = 1.0
MIN_EVENTS_PER_WINDOW = 100  # fewer say little about the cost of one
# While pacing, one window in this many lets streams run free to measure an event's cost again:
# paced windows cannot (below), and the load may have changed since.
PROBE_EVERY = 5


class StreamPacer:
    def __init__(self, events_per_s: float | None = None, max_delay_s: float = MAX_DELAY_S,
                 cpu_share: float = CPU_SHARE, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time):
        self.adaptive = events_per_s is None
        self.events_per_s = INITIAL_EVENTS_PER_S if events_per_s is None else events_per_s  # 0: off
        self.max_delay_s = max_delay_s
        self.cpu_share = cpu_share
        self.num_streams = 0
        self.pacing = not self.adaptive  # an adaptive pacer waits for its first measure
        self._clock, self._cpu_clock = clock, cpu_clock
        self._window_start, self._window_cpu = clock(), cpu_clock()
        self._window_events = 0
        self._paced_windows = 0
        self._probing = False  # this window runs free, to measure

    def interval_s(self) -> float:
        """How long a stream waits after its previous event before the next."""
        if not self.events_per_s or not self.pacing or self._probing:
            return 0.0
        return min(self.num_streams / self.events_per_s, self.max_delay_s)

    def sent(self) -> None:
        """Count one event; at the end of a window, re-measure the budget."""
        if not self.adaptive:
            return
        self._window_events += 1
        now = self._clock()
        if now - self._window_start < WINDOW_S:
            return
        cpu = self._cpu_clock()
        if self._window_events >= MIN_EVENTS_PER_WINDOW:
            cpu_used = cpu - self._window_cpu
            usage = cpu_used / (now - self._window_start)  # cores
            if not self.pacing or self._probing:
                # Measured only while events flow freely: paced, the work that does not follow
                # the events (taking requests, reading the engines' outputs) spreads over fewer
                # of them, and each window would read a dearer event and tighten the budget
                # again, down to max_delay_s, saving nothing.
                cpu_per_event = max(cpu_used / self._window_events, 1e-9)
                self.events_per_s = min(max(self.cpu_share / cpu_per_event, MIN_EVENTS_PER_S),
                                        MAX_EVENTS_PER_S)
                self.pacing, self._probing = usage >= self.cpu_share, False
            else:
                self.pacing = usage >= self.cpu_share * RELEASE
                self._paced_windows += self.pacing
                self._probing = self.pacing and self._paced_windows % PROBE_EVERY == 0
        self._window_start, self._window_cpu, self._window_events = now, cpu, 0
