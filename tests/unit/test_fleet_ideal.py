"""The ideal's capacity search (`bench.fleet.ideal`), on fleets whose capacity is known."""
import math

import pytest

from bench.fleet.ideal import (Capacity, capacities, foresight_replica_seconds,
                               ideal_replica_seconds, replicas_for)


class Known:
    """A measure whose fleet of n replicas holds rates up to capacity(n); counts its runs and
    its rounds."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.runs = []
        self.rounds = 0

    def __call__(self, n, rates):
        self.rounds += 1
        self.runs += [(n, rate) for rate in rates]
        return [rate <= self.capacity(n) for rate in rates]


@pytest.mark.parametrize("capacity", [lambda n: 9.3 * n, lambda n: 4 + 11 * n - 0.1 * n * n,
                                      lambda n: 25.0 if n < 3 else 31.0 * n])
@pytest.mark.parametrize("width", [1, 2, 3])
def test_each_fleet_size_is_bracketed_to_the_precision_around_its_capacity(capacity, width):
    trial = Known(capacity)
    found = capacities(trial, peak_rate=120.0, precision=1.0, max_replicas=30, width=width)
    assert [c.replicas for c in found] == list(range(1, len(found) + 1))
    for c in found[:-1]:
        assert c.holds <= capacity(c.replicas) < c.fails <= c.holds + 1.0
    last = found[-1]
    assert last.holds == 120.0 and last.fails == math.inf  # the first to hold the peak ends it
    assert capacity(last.replicas - 1) < 120.0 <= capacity(last.replicas)
    assert trial.rounds <= 7 * len(found)  # a search, not a sweep


def test_measuring_several_rates_at_once_narrows_in_fewer_rounds():
    one, two = Known(lambda n: 9.3 * n), Known(lambda n: 9.3 * n)
    assert capacities(one, 120.0, 1.0, 30, width=1)[-1].replicas == 13
    assert capacities(two, 120.0, 1.0, 30, width=2)[-1].replicas == 13
    assert two.rounds < 0.8 * one.rounds


def test_a_rate_held_above_one_that_failed_does_not_widen_the_bracket():
    """Measurements are noisy near the capacity: a higher rate may hold where a lower failed."""
    found = capacities(Known(lambda n: 9.3 * n), 120.0, 1.0, 30, width=3)
    noisy = capacities(lambda n, rates: [r <= 9.3 * n or 9.3 * n + 3 < r < 9.3 * n + 3.5
                                         for r in rates], 120.0, 1.0, 30, width=3)
    for c in noisy[:-1]:
        assert c.holds < c.fails <= c.holds + 1.0
    assert len(noisy) >= len(found) - 1


def test_a_fleet_that_never_holds_the_peak_stops_at_max_replicas():
    found = capacities(Known(lambda n: 2.0 * n), 120.0, 1.0, max_replicas=5)
    assert [c.replicas for c in found] == [1, 2, 3, 4, 5]
    assert replicas_for(100.0, found, optimistic=True) == 6


def test_the_ideal_is_bounded_by_the_brackets():
    found = [Capacity(1, 9.0, 10.0), Capacity(2, 19.0, 20.0), Capacity(3, 30.0)]
    assert replicas_for(9.5, found, optimistic=True) == 1  # the capacity may be just under 10
    assert replicas_for(9.5, found, optimistic=False) == 2  # or just over 9
    assert replicas_for(9.0, found, optimistic=False) == 1
    assert replicas_for(25.0, found, optimistic=True) == 3

    class Day:
        class settings:
            duration_s = 4

        @staticmethod
        def rate_at(t):
            return [5.0, 9.5, 19.5, 25.0][int(t)]

    assert ideal_replica_seconds(Day, found, min_replicas=1) == 1 + 1 + 2 + 3
    assert ideal_replica_seconds(Day, found, min_replicas=1, optimistic=False) == 1 + 2 + 3 + 3
    assert ideal_replica_seconds(Day, found, min_replicas=2) == 2 + 2 + 2 + 3


def test_knowing_the_future_under_the_delays_holds_each_need_from_lead_before_to_hold_after():
    found = [Capacity(1, 10.0, 11.0), Capacity(2, 20.0, 21.0), Capacity(3, 30.0)]

    class Day:
        class settings:
            duration_s = 6

        @staticmethod
        def rate_at(t):
            return [5.0, 5.0, 25.0, 5.0, 5.0, 5.0][int(t)]  # needs 1, 1, 3, 1, 1, 1

    assert foresight_replica_seconds(Day, found, 1, lead_s=0, hold_s=0) == 8
    assert foresight_replica_seconds(Day, found, 1, lead_s=1, hold_s=0) == 1 + 3 + 3 + 1 + 1 + 1
    assert foresight_replica_seconds(Day, found, 1, lead_s=1, hold_s=2) == 1 + 3 + 3 + 3 + 3 + 1
