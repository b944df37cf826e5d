"""bench.fleet.clock: events run in time order, ties in scheduling order."""
import pytest

from bench.fleet.clock import EventQueue


def test_events_run_in_time_then_insertion_order():
    q, seen = EventQueue(), []
    q.at(2.0, lambda: seen.append("b"))
    q.at(1.0, lambda: seen.append("a"))
    q.at(2.0, lambda: seen.append("c"))
    q.at(1.0, lambda: q.after(0.5, lambda: seen.append(("d", q.now))))
    q.run(until=10.0)
    assert seen == ["a", ("d", 1.5), "b", "c"]
    assert q.now == 10.0 and q.num_events == 5


def test_run_stops_at_until_and_keeps_later_events():
    q, seen = EventQueue(), []
    q.at(1.0, lambda: seen.append(q()))
    q.at(3.0, lambda: seen.append(q()))
    q.run(until=2.0)
    assert seen == [1.0] and q.now == 2.0
    q.run(until=5.0)
    assert seen == [1.0, 3.0]


def test_every_repeats_up_to_until_and_the_past_is_refused():
    q, seen = EventQueue(), []
    q.every(1.0, lambda: seen.append(q.now), start=0.5, until=3.0)
    q.run(until=10.0)
    assert seen == [0.5, 1.5, 2.5]
    with pytest.raises(ValueError):
        q.at(1.0, lambda: None)
