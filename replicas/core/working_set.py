"""The prefix cache's reused working set: how many distinct blocks the replica's prompts looked up
more than once within a window, i.e. the cache it needs for its reuse to become hits.

The autoscaler reads it. Queue depth and load say how much compute a fleet needs; neither says
how much cache. A fleet serving 150 tenants' 6,000-token contexts needs their 56,000 blocks
cached somewhere: scaled down below that, every request re-prefills its context, each
replica does several times the work, the queues explode and the fleet scales back up, in a cycle.
This count sees the need before the cache is short, since it counts lookups, not hits: a
thrashing replica reports all the reuse it failed to serve. Blocks looked up once (unique
prompts) do not count: caching them gains nothing.

Two half-window generations of plain sets, all C-level set operations per lookup (no per-block
Python loop); `measure(now)` rotates them and costs O(1), so the engine's stats, read many
times a second, drive the clock and the block manager stays clockless.
"""
from __future__ import annotations

from collections.abc import Iterable

DEFAULT_WINDOW_S = 60.0  # the autoscaler's downscale delay: reuse the fleet must keep serving


class WorkingSet:
    __slots__ = ("window_s", "seen", "seen_before", "reused", "reused_before", "num_new",
                 "started")

    def __init__(self, window_s: float = DEFAULT_WINDOW_S):
        self.window_s = window_s
        self.seen: set[int] = set()  # looked up in this half-window
        self.seen_before: set[int] = set()  # ... in the previous one
        self.reused: set[int] = set()  # looked up again, in this half-window
        self.reused_before: set[int] = set()
        self.num_new = 0  # len(reused - reused_before), kept as they grow: measure() is O(1)
        self.started: float | None = None

    def touch(self, block_hashes: Iterable[int]) -> None:
        """One prompt's full blocks, as the scheduler looked them up."""
        hashes = set(block_hashes)
        again = (hashes & self.seen) | (hashes & self.seen_before)
        if again:
            again -= self.reused
            self.reused |= again
            self.num_new += len(again - self.reused_before)
        self.seen |= hashes

    def measure(self, now: float) -> int:
        """Distinct blocks reused within the last half to whole window (the generations turn
        every half window: a reuse Δ seconds after a lookup counts if Δ is under half a window,
        may count up to a whole one)."""
        if self.started is None:
            self.started = now
        elif now - self.started >= self.window_s / 2:
            if now - self.started >= self.window_s:  # not measured for a whole window: all stale
                self.seen, self.reused = set(), set()
            self.seen_before, self.seen = self.seen, set()
            self.reused_before, self.reused = self.reused, set()
            self.num_new = 0
            self.started = now
        return len(self.reused_before) + self.num_new
