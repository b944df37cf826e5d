"""The autoscaling yardstick: how many replicas the offered load needs, measured in the same
simulator.

"Just enough replicas for the offered load at the target queue depth" is the fewest replicas
that, held fixed under that load, keep the queue at or under the target in steady state. A
formula from the cost model (work per request / work per replica-second) misses what decides it
here: a fleet must also hold its tenants' shared contexts in its KV caches, and batches are
bounded by KV blocks before they are by compute, so a replica's capacity depends on the fleet's
size. So it is measured: for n = 1, 2, ... replicas, the highest constant rate of the workload's
prompts (the router under test, no autoscaler) under which the queue stays at or under the
target over the second half of a run: the fleet's capacity, bracketed between a rate it held
and one it did not, `precision` apart. Each second of a run then needs the fewest replicas
whose capacity reaches its rate. Inside a bracket that is unknown, so the ideal comes as two
bounds: `replica_seconds` (capacities at their brackets' tops, the fewest replicas possible;
ratios are taken against it) and `replica_seconds_upper` (at their bottoms).
"""
from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable
from contextlib import contextmanager
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from bench.fleet.cost_model import CostModel
from bench.fleet.fleet import Fleet, FleetSettings
from bench.fleet.report import queue_per_replica
from bench.fleet.workloads import Workload, WorkloadSettings

WARMUP_FRACTION = 0.5  # the first half of each run fills the caches; the second is measured
FIRST_STEP = 0.1  # of the peak rate: the first guess at one replica's capacity


class ConstantRate(Workload):
    """A workload's prompts at one constant rate."""

    def __init__(self, name: str, settings, seed: int, rate: float):
        super().__init__(name, replace(settings, rate=rate), seed)

    def rate_at(self, t: float) -> float:
        return self.settings.rate

    def stage_rates(self) -> list[float]:
        return [self.settings.rate]

    def stage_of(self, t: float) -> int:
        return 0


def mean_queue_per_replica(fleet: Fleet, since_s: float) -> float:
    """Waiting requests per replica, averaged over the samples from since_s on."""
    values = [q for t, q in zip(fleet.series["t"], queue_per_replica(fleet)) if t >= since_s]
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class Trial:
    """One measurement: does a fleet of num_replicas hold `rate`? Picklable: it runs in a worker
    process when the search measures several rates at once."""
    router: str
    workload: str
    workload_settings: WorkloadSettings  # duration_s: the run's
    model: CostModel
    settings: FleetSettings
    target_queue_depth: float
    seed: int

    def holds(self, num_replicas: int, rate: float) -> bool:
        workload = ConstantRate(self.workload, self.workload_settings, self.seed, rate)
        fleet = Fleet(self.router, workload, self.model,
                      replace(self.settings, num_replicas=num_replicas, autoscaler=None),
                      self.seed).run()
        warmup = WARMUP_FRACTION * self.workload_settings.duration_s
        return mean_queue_per_replica(fleet, warmup) <= self.target_queue_depth


@contextmanager
def measured_by(trial: Trial, jobs: int):
    """`measure(n, rates)` for `capacities`: `trial` at each rate, in `jobs` worker processes
    (spawned: nothing inherited but the trial) when more than one."""
    if jobs <= 1:
        yield lambda n, rates: [trial.holds(n, rate) for rate in rates]
        return
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda n, rates: list(pool.map(trial.holds, [n] * len(rates), rates))


@dataclass
class Capacity:
    """n replicas held `holds` req/s and did not hold `fails` (inf: not measured, as n held the
    peak)."""
    replicas: int
    holds: float
    fails: float = math.inf


def capacities(measure: Callable[[int, list[float]], list[bool]], peak_rate: float,
               precision: float, max_replicas: int, width: int = 1) -> list[Capacity]:
    """Each fleet size's capacity, from 1 replica up to the first that holds peak_rate (or
    max_replicas). measure(n, rates) says whether n replicas hold each rate; it gets `width`
    rates at a time (as many as it measures at once), which split the bracket into width + 1
    parts. A fleet holds at least what a smaller one held, so each search starts from the last
    capacity and steps up by the last gain, doubling while every rate holds."""
    found: list[Capacity] = []
    gain = FIRST_STEP * peak_rate
    for n in range(1, max_replicas + 1):
        lo = found[-1].holds if found else 0.0
        hi = math.inf
        step = gain
        while hi - lo > precision and lo < peak_rate:
            if hi == math.inf:  # up to lo + step, the last point on it
                top = min(lo + step, peak_rate)
                points = [lo + (top - lo) * (i + 1) / width for i in range(width)]
                step *= 2
            else:
                points = [lo + (hi - lo) * (i + 1) / (width + 1) for i in range(width)]
            held = measure(n, points)
            # The new bracket: the lowest rate that failed, the highest below it that held.
            hi = min([hi] + [r for r, ok in zip(points, held) if not ok])
            lo = max([lo] + [r for r, ok in zip(points, held) if ok and r < hi])
        found.append(Capacity(n, lo, hi if lo < peak_rate else math.inf))
        if lo >= peak_rate:
            break
        gain = max(precision, lo - (found[-2].holds if len(found) > 1 else 0.0))
    return found


def replicas_for(rate: float, found: list[Capacity], optimistic: bool) -> int:
    """The fewest replicas whose capacity reaches rate: at its bracket's top when optimistic,
    its bottom otherwise; one more than the largest measured when none does."""
    for c in found:
        if (rate < c.fails if optimistic else rate <= c.holds):
            return c.replicas
    return found[-1].replicas + 1 if found else 1


def ideal_replicas(workload: Workload, found: list[Capacity], min_replicas: int,
                   optimistic: bool = True) -> list[int]:
    """The replicas each second of the run needs (see replicas_for)."""
    return [max(min_replicas, replicas_for(workload.rate_at(t + 0.5), found, optimistic))
            for t in range(int(workload.settings.duration_s))]


def ideal_replica_seconds(workload: Workload, found: list[Capacity], min_replicas: int,
                          optimistic: bool = True) -> float:
    return float(sum(ideal_replicas(workload, found, min_replicas, optimistic)))


def foresight_replica_seconds(workload: Workload, found: list[Capacity], min_replicas: int,
                              lead_s: float, hold_s: float) -> float:
    """What a policy that knew the future would use under Ray's delays: a replica serves lead_s
    after it is asked for (upscale delay + start-up), and stays hold_s (the downscale delay)
    after it was last needed; so each second takes the most any second from hold_s before to
    lead_s after it needs. The ideal's low end, on the same capacities."""
    need = ideal_replicas(workload, found, min_replicas)
    duration = len(need)
    lead, hold = math.ceil(lead_s), math.ceil(hold_s)
    return float(sum(max(need[max(0, t - hold):t + lead + 1]) for t in range(duration)))
