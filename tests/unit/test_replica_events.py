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


def test_a_finished_request_ends_the_routers_record_of_its_call():
    # Ray Serve does not report every call's end to the router; the ingress's own end of the
    # request must clear it, or a long-running ingress accumulates one entry per such call.
    channels = OutputChannels(None)
    channels.register("req")
    channels.track("call-9", "req")
    replica_events.routed("call-9", "r9")
    channels.unregister("req", "call-9")
    assert "call-9" not in replica_events._in_flight


def test_each_call_from_the_ingresss_own_http_server_gets_its_own_id():
    # Without Ray Serve's proxy a request carries no internal id: the ingress must make one it
    # knows (to fail the call if its replica dies), and fanned-out calls must not share one.
    import contextvars

    from serve_app.replica_stream import _own_call_id, as_own_call

    def ids():
        first = _own_call_id()
        return first, _own_call_id(), as_own_call(_own_call_id, 1)()

    a = contextvars.Context().run(ids)
    b = contextvars.Context().run(ids)
    assert a[0] and a[0] == a[1] and a[2] == f"{a[0]}-1"
    assert a[0] != b[0]


def test_a_call_ray_reported_ended_is_still_failed_when_its_replica_dies():
    # Ray Serve reports a call to a killed replica as ended before it reports the death, and the
    # ingress's stream of it may never end: the death must still reach it.
    seen = []
    replica_events.on_replica_lost(lambda replica, calls: seen.append((replica, calls)))
    replica_events.routed("call-x", "r7")
    replica_events.routed("call-y", "r7")
    replica_events.ended("call-x")  # Ray: ended
    replica_events.ended("call-y")
    replica_events.completed("call-y")  # ...and the ingress finished with this one
    replica_events.replica_died("r7")
    assert seen[-1] == ("r7", {"call-x"})
    assert "call-x" not in replica_events._recently_ended
