"""How much of a replica's compute its work uses: the time its steps spent beyond a step's fixed
cost, over a recent window.

The autoscaler reads it. Under continuous batching an engine with any request running steps
back to back, so the fraction of time it is busy reads ~1 at any load; and batches stay small
until the load nears capacity (a light load's requests finish quickly), so the batch's fill
rises only at the cliff. Each step costs a fixed part (reading the weights, the step's own
Python) plus a part per token; the fixed part is what a step's batch shares. This is the
per-token part's share of the wall clock, which grows with the load in proportion up to
capacity.

The fixed part is the time of the lightest step, one token of one sequence, averaged over such
steps as they come (the mean, not the fastest: a light step's jitter is not load), so a
saturated window of big steps does not hide it. Before any such step, the fastest step seen
stands in.

Pure Python; the engine records each step's wall time, `utilization(now)` reads the window.
"""
from __future__ import annotations

import math
from collections import deque

DEFAULT_WINDOW_S = 5.0
_LIGHT_STEP_WEIGHT = 0.05  # the light steps' running mean: the last few dozen


class StepLoad:
    __slots__ = ("window_s", "steps", "busy_s", "fastest_s", "light_s")

    def __init__(self, window_s: float = DEFAULT_WINDOW_S):
        self.window_s = window_s
        self.steps: deque[tuple[float, float]] = deque()  # (end time, seconds) in the window
        self.busy_s = 0.0  # their sum
        self.fastest_s = math.inf
        self.light_s: float | None = None  # the lightest steps' running mean

    @property
    def fixed_s(self) -> float:
        return self.light_s if self.light_s is not None else self.fastest_s

    def record(self, end: float, step_s: float, num_tokens: int) -> None:
        """A step that ended at `end`, took step_s and computed num_tokens tokens."""
        if step_s < self.fastest_s:
            self.fastest_s = step_s
        if num_tokens == 1:
            light = self.light_s
            self.light_s = (step_s if light is None
                            else light + (step_s - light) * _LIGHT_STEP_WEIGHT)
        self.steps.append((end, step_s))
        self.busy_s += step_s

    def utilization(self, now: float) -> float:
        steps = self.steps
        horizon = now - self.window_s
        while steps and steps[0][0] < horizon:
            self.busy_s -= steps.popleft()[1]
        if not steps:
            self.busy_s = 0.0  # no float drift carried into the next busy spell
            return 0.0
        work = self.busy_s - len(steps) * self.fixed_s
        return min(1.0, max(0.0, work / self.window_s))
