"""The autoscaling yardstick: how many replicas the offered load needs, measured in the same
simulator.

"Just enough replicas for the offered load at the target queue depth" is the fewest replicas
that, held fixed under that load, keep the queue at or under the target in steady state. A
formula from the cost model (work per request / work per replica-second) misses what decides it
here: a fleet must also hold its tenants' shared contexts in its KV caches, and batches are
bounded by KV blocks before they are by compute, so a replica's capacity depends on the fleet's
size. So it is measured: for each of a ladder of constant rates (the workload's prompts, the
router under test, no autoscaler), the fewest replicas whose queue stays at or under the target
over the second half of a run. The ideal replica-seconds of a run are those counts under its
rate curve, each second taking the ladder's rung at or below its rate (a lower bound).
"""
from __future__ import annotations

import bisect
from dataclasses import replace

from bench.fleet.cost_model import CostModel
from bench.fleet.fleet import Fleet, FleetSettings
from bench.fleet.report import queue_per_replica
from bench.fleet.workloads import Workload

WARMUP_FRACTION = 0.5  # the first half of each run fills the caches; the second is measured


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


def holds(router: str, workload: Workload, model: CostModel, settings: FleetSettings,
          num_replicas: int, target_queue_depth: float, seed: int) -> bool:
    fleet = Fleet(router, workload, model, replace(settings, num_replicas=num_replicas,
                                                   autoscaler=None), seed).run()
    warmup = WARMUP_FRACTION * workload.settings.duration_s
    return mean_queue_per_replica(fleet, warmup) <= target_queue_depth


def replicas_needed(router: str, workload: Workload, model: CostModel, settings: FleetSettings,
                    rates: list[float], run_s: float, target_queue_depth: float, seed: int,
                    max_replicas: int) -> list[int]:
    """The fewest replicas holding each rate (ascending rates; max_replicas + 1 if none do).
    The count only grows with the rate, so each rate's search starts at the last one's."""
    def constant(rate: float) -> ConstantRate:  # a fresh one per run: the same requests
        return ConstantRate(workload.name, replace(workload.settings, duration_s=run_s), seed, rate)

    needed, n = [], 1
    for rate in rates:
        while n <= max_replicas and not holds(router, constant(rate), model, settings, n,
                                              target_queue_depth, seed):
            n += 1
        needed.append(n)
    return needed


def ladder(workload: Workload, num_rungs: int) -> list[float]:
    """num_rungs rates evenly from the run's lowest to its highest."""
    rates = [workload.rate_at(t + 0.5) for t in range(int(workload.settings.duration_s))]
    low, high = min(rates), max(rates)
    return [low + (high - low) * i / max(1, num_rungs - 1) for i in range(num_rungs)]


def ideal_replica_seconds(workload: Workload, rates: list[float], needed: list[int],
                          min_replicas: int) -> float:
    """Each second of the run: the replicas the highest ladder rate at or below its rate needs."""
    total = 0.0
    for t in range(int(workload.settings.duration_s)):
        k = bisect.bisect_right(rates, workload.rate_at(t + 0.5)) - 1
        total += max(min_replicas, needed[k] if k >= 0 else 1)
    return total
