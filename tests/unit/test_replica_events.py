"""When the router learns a replica died, the calls in flight on it fail with a 503 at once (a
streaming call to a killed replica does not always end by itself)."""
from __future__ import annotations

import asyncio

import pytest

from serve_app.errors import OpenAIError
from serve_app.replica_stream import OutputChannels
from serve_app.routing import replica_events


def test_the_calls_on_a_dead_replica_are_reported_once():
    seen = []
    replica_events.on_replica_lost(lambda replica, calls: seen.append((replica, calls)))
    replica_events.routed("call-a", "r1")
    replica_events.routed("call-b", "r2")
    replica_events.routed("call-c", "r1")
    replica_events.completed("call-c")
    replica_events.replica_died("r1")
    replica_events.replica_died("r1")
    assert seen[-2:] == [("r1", {"call-a"}), ("r1", set())]
    replica_events.completed("call-b")


def test_output_channels_fail_the_requests_of_a_lost_replica():
    channels = OutputChannels(None, retry_after_s=3)
    lost, kept = channels.register("req-lost"), channels.register("req-kept")
    channels.track("call-1", "req-lost")
    channels.track("call-2", "req-kept")
    replica_events.routed("call-1", "dead")
    replica_events.routed("call-2", "alive")
    replica_events.replica_died("dead")

    async def first(queue):
        return await asyncio.wait_for(queue.get(), 1)
    with pytest.raises(OpenAIError) as error:
        asyncio.run(first(lost))
    assert error.value.status_code == 503 and error.value.retry_after_s == 3
    assert kept.get_nowait() is None  # untouched
    replica_events.completed("call-2")
