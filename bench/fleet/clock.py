"""Simulated time: one heap of timed callbacks, run in (time, insertion) order."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    """Events at equal times run in the order they were scheduled, so runs are deterministic."""

    def __init__(self):
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._counter = itertools.count()
        self.num_events = 0

    def __call__(self) -> float:
        """The clock itself: pass the queue wherever a `clock()` is expected."""
        return self.now

    def at(self, time: float, callback: Callable[[], None]) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        heapq.heappush(self._heap, (time, next(self._counter), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self.at(self.now + delay, callback)

    def every(self, period: float, callback: Callable[[], None], start: float | None = None,
              until: float | None = None) -> None:
        """callback at start, start + period, ... (up to until, if given)."""
        def tick(at: float) -> None:
            callback()
            if until is None or at + period <= until:
                self.at(at + period, lambda: tick(at + period))
        first = self.now if start is None else start
        self.at(first, lambda: tick(first))

    def run(self, until: float) -> None:
        """Run every event due at or before `until`; the clock ends at `until`."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            time, _, callback = heapq.heappop(heap)
            self.now = time
            callback()
            self.num_events += 1
        self.now = max(self.now, until)
