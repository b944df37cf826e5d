"""Output channels, the request router's pin for them, and stream pacing, without Ray."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from replicas.deployment import ChannelRequest, GenerateRequest, ReplicaHello
from replicas.output_channel import OutputChannel
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import SamplingParams
from serve_app.replica_stream import OutputChannels, ReplicaStream
from serve_app.stream_pacer import StreamPacer
from serve_app.routing.router import pinned_replica


def delta(request_id: str, text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, None, [], [CompletionOutput(0, text, [len(text)],
                                                                 finish_reason="stop" if finished else None)],
                         finished=finished, num_prompt_tokens=2)


def test_an_output_crosses_the_wire_as_plain_values_and_comes_back_equal():
    import pickle

    from replicas.outputs import Logprob
    full = RequestOutput("r", "hi", [1, 2], [
        CompletionOutput(0, "a", [5], -0.5, [{5: Logprob(-0.5, 1, "a")}]),
        CompletionOutput(1, "b", [6, 7], None, None, "stop", 7)], finished=True,
        prompt_logprobs=[None, {2: Logprob(-1.0, 3, "x")}], num_cached_tokens=16,
        num_prompt_tokens=2, metrics={"arrival_time": 1.0}, embedding=[0.5])
    for output in (full, delta("d", "tok")):
        values = output.wire()
        assert RequestOutput.from_wire(pickle.loads(pickle.dumps(values))) == output
    # The common delta is nothing but tuples, lists and scalars: the pickler never calls Python.
    plain = (tuple, list, str, int, float, bool, type(None))

    def walk(value):
        assert isinstance(value, plain), type(value)
        if isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
    walk(delta("d", "tok").wire())


def test_a_channel_sends_one_batch_per_wakeup_with_each_request_folded():
    async def run():
        channel = OutputChannel(idle_timeout_s=0.05)
        channel.attach("a")
        channel.attach("b")
        batches = channel.batches()
        channel.put(delta("a", "x"))
        channel.put(delta("b", "y"))
        channel.put(delta("a", "z"))  # same step or later, before the batch left: folded
        first = await anext(batches)
        channel.put(delta("b", "!", finished=True))
        second = await anext(batches)
        channel.detach("a")
        channel.detach("b")
        rest = [b async for b in batches]  # idle: the channel ends itself
        return first, second, rest, channel.closed

    first, second, rest, closed = asyncio.run(run())
    assert [(o.request_id, o.outputs[0].text) for o in first] == [("a", "xz"), ("b", "y")]
    assert [(o.request_id, o.outputs[0].text, o.finished) for o in second] == [("b", "!", True)]
    assert rest == [] and closed


def test_a_channel_with_requests_never_idles_out():
    async def run():
        channel = OutputChannel(idle_timeout_s=0.01)
        channel.attach("a")
        batches = channel.batches()
        waiter = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0.1)
        assert not waiter.done() and not channel.closed
        channel.put(delta("a", "late"))
        return await waiter

    assert [o.outputs[0].text for o in asyncio.run(run())] == ["late"]


def test_the_router_pins_channel_calls_only():
    pending = SimpleNamespace(args=(ChannelRequest("replica-1", "ingress-a"),), kwargs={})
    assert pinned_replica(pending) == "replica-1"
    request = GenerateRequest("r", [1, 2], SamplingParams(), channel_id="ingress-a")
    assert pinned_replica(SimpleNamespace(args=(request,), kwargs={})) is None
    assert pinned_replica(None) is None


class FakeCall:
    """A replica call's generator: yields what it is given, then ends."""

    def __init__(self, items):
        self.items = list(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        self.items = []
        self.cancelled = True


def test_a_stream_on_its_own_call_names_its_replica_and_a_paced_consumer_gets_folded_outputs():
    opened = []

    def open_call(request: ChannelRequest):
        opened.append(request)
        return FakeCall([])

    async def run():
        channels = OutputChannels(open_call)
        outputs = [ReplicaHello("replica-7")] + [delta("r", c) for c in "abcde"] + \
            [delta("r", "!", finished=True)]
        stream = ReplicaStream(lambda: FakeCall(outputs), lambda exc: exc, channels, "r",
                               StreamPacer(events_per_s=10))  # one stream: 100 ms apart
        await stream.prime()
        got = [o.outputs[0].text async for o in stream]
        await asyncio.sleep(0.01)
        return got

    got = asyncio.run(run())
    assert "".join(got) == "abcde!" and len(got) < 6, got
    assert opened and opened[0].replica_id == "replica-7"


def test_pacing_spreads_the_budget_over_open_streams():
    pacer = StreamPacer(events_per_s=1000)
    assert pacer.interval_s() == 0
    pacer.num_streams = 16
    assert pacer.interval_s() == 0.016
    pacer.num_streams = 64
    assert pacer.interval_s() == 0.02  # never longer than max_delay_s (20 ms)
    assert StreamPacer(0).interval_s() == 0.0


def test_an_adaptive_pacer_budgets_events_by_their_measured_cpu_cost():
    clock = {"wall": 0.0, "cpu": 0.0}
    pacer = StreamPacer(cpu_share=0.5, clock=lambda: clock["wall"], cpu_clock=lambda: clock["cpu"])
    for _ in range(1000):  # one second: 1000 events at 1 ms of CPU each
        clock["wall"] += 0.001
        clock["cpu"] += 0.001
        pacer.sent()
    assert pacer.events_per_s == pytest.approx(500)  # half a core's worth
    pacer.num_streams = 5
    assert pacer.interval_s() == pytest.approx(0.01)
    for _ in range(10):  # a quiet second: too few events to measure, the estimate stays
        clock["wall"] += 0.1
        pacer.sent()
    assert pacer.events_per_s == pytest.approx(500)
    fixed = StreamPacer(events_per_s=250)
    fixed.sent()
    assert fixed.events_per_s == 250 and not fixed.adaptive


def test_an_adaptive_pacer_holds_streams_back_only_while_the_ingress_uses_its_share():
    clock = {"ms": 0, "cpu": 0.0}  # whole milliseconds: each second closes a window exactly
    pacer = StreamPacer(cpu_share=0.5, clock=lambda: clock["ms"] / 1000,
                        cpu_clock=lambda: clock["cpu"])
    pacer.num_streams = 32

    def second(cores: float):  # 1000 events in a second, using this much CPU
        for _ in range(1000):
            clock["ms"] += 1
            clock["cpu"] += 0.001 * cores
            pacer.sent()

    assert pacer.interval_s() == 0  # nothing measured yet
    second(0.3)
    assert pacer.interval_s() == 0, "below its share, waiting would only add latency"
    second(0.6)
    assert pacer.pacing and pacer.interval_s() == pytest.approx(min(32 / pacer.events_per_s, 0.02))
    second(0.45)  # paced, a little under the share: stays paced (no flapping at the edge)
    assert pacer.pacing
    second(0.3)
    assert not pacer.pacing and pacer.interval_s() == 0


def test_a_paced_window_leaves_the_budget_as_measured_unpaced():
    """Paced, fewer events carry the work that does not follow them (requests, the engines'
    outputs): a dearer event read then must not tighten the budget further."""
    clock = {"ms": 0, "cpu": 0.0}
    pacer = StreamPacer(cpu_share=0.5, clock=lambda: clock["ms"] / 1000,
                        cpu_clock=lambda: clock["cpu"])

    def second(events: int, cores: float):
        for _ in range(events):
            clock["ms"] += 1000 // events
            clock["cpu"] += cores / events
            pacer.sent()

    pacer.num_streams = 32
    second(1000, 0.8)  # free: 0.8 ms an event, over the share
    assert pacer.pacing and pacer.events_per_s == pytest.approx(625)
    for _ in range(5):  # paced: half the events, the same CPU
        assert pacer.interval_s() > 0
        second(500, 0.8)
    assert pacer.pacing and pacer.events_per_s == pytest.approx(625)
    # Every fifth paced window, the next runs free and measures again (the load changes).
    assert pacer.interval_s() == 0
    second(1000, 0.6)
    assert pacer.pacing and pacer.events_per_s == pytest.approx(0.5 / 0.0006)
    assert pacer.interval_s() > 0


def test_a_consumer_that_leaves_early_cancels_the_call():
    call = FakeCall([delta("r", c) for c in "abcdef"])

    async def run():
        channels = OutputChannels(None)
        stream = ReplicaStream(lambda: call, lambda exc: exc, channels, "r")
        await stream.prime()
        iterator = stream.__aiter__()
        await anext(iterator)
        await iterator.aclose()  # the client went away
        stream.cancel()  # what the ingress does then
        return channels

    channels = asyncio.run(run())
    assert getattr(call, "cancelled", False) and "r" not in channels._queues


class FakeEngine:
    """The AsyncEngine surface a replica's channel path uses."""

    def __init__(self):
        self.receivers, self.aborted = {}, []

    def add_request(self, request_id, prompt, params, on_output, priority=0):
        self.receivers[request_id] = on_output

    def abort_nowait(self, request_id):
        self.aborted.append(request_id)

    def is_healthy(self):
        return True


def bare_replica():
    from replicas.deployment import EngineReplica

    replica = EngineReplica.__new__(EngineReplica)  # no Ray, no model: the channel logic only
    replica.engine, replica.replica_id = FakeEngine(), "replica-1"
    replica._channels, replica._channel_requests = {}, {}
    return replica


def test_requests_by_channel_finish_cleanly_and_die_with_their_channel():
    from replicas.output_channel import ChannelClosed

    async def run():
        replica = bare_replica()
        channel = replica.open_channel(ChannelRequest("replica-1", "ingress-a"))
        assert await anext(channel) == []
        calls = {rid: replica.generate(GenerateRequest(rid, [1, 2], SamplingParams(),
                                                       channel_id="ingress-a"))
                 for rid in ("done", "cut")}
        waits = {rid: asyncio.ensure_future(anext(call)) for rid, call in calls.items()}
        await asyncio.sleep(0)
        replica.engine.receivers["done"](delta("done", "all", finished=True))
        replica.engine.receivers["cut"](delta("cut", "half"))
        batch = await anext(channel)
        with pytest.raises(StopAsyncIteration):  # yields nothing: its outputs went by channel
            await waits["done"]
        await channel.aclose()  # the ingress went away mid-request
        with pytest.raises(ChannelClosed):
            await waits["cut"]
        return replica, batch

    replica, batch = asyncio.run(run())
    batch = [RequestOutput.from_wire(values) for values in batch]
    assert sorted((o.request_id, o.outputs[0].text) for o in batch) == [("cut", "half"),
                                                                          ("done", "all")]
    assert replica.engine.aborted == ["cut"]  # the finished one is not aborted
    assert replica._channels == {} and replica._channel_requests == {}
