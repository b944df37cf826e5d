"""The ingress's requests sent straight to engine cores on its channels (serve_app/core_dispatch.py),
against cores played by TCP servers on localhost that speak the channel's wire: down the router's
ranking past a core that refuses, by Ray past the cores with a channel, a broken channel failing
exactly its requests, a cancel sent as an abort; the router counts each where it went."""
from __future__ import annotations

import asyncio
import time

import pytest

from replicas import core_wire as wire
from replicas.deployment import GenerateRequest
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import SamplingParams
from serve_app.errors import OpenAIError
from serve_app.replica_stream import OutputChannels, ReplicaStream
from serve_app.routing.policy import FALLBACK, Decision
from serve_app.routing.router_state import RouterState
from tests.unit.test_output_channel import FakeCall

TOKEN = "t" * wire.CHANNEL_TOKEN_BYTES


def output(request_id: str, text: str, finished: bool) -> tuple:
    return RequestOutput(request_id, None, [], [CompletionOutput(
        0, text, [len(text)], finish_reason="stop" if finished else None)],
        finished=finished, num_prompt_tokens=2).wire()


class FakeCore:
    """A core's channel end: records what the ingress sends; `answer(message)` says what to
    send back for each request."""

    def __init__(self, answer):
        self.answer = answer
        self.received: list[list] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> tuple[str, int, str]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return "127.0.0.1", self.server.sockets[0].getsockname()[1], TOKEN

    async def _serve(self, reader, writer):
        self.writers.append(writer)
        await reader.readexactly(wire.CHANNEL_HELLO_SIZE)
        frames = wire.FrameReader(wire.channel_loads)
        while data := await reader.read(1 << 16):
            for message in frames.feed(data):
                self.received.append(message)
                reply = self.answer(message)
                if reply is not None:
                    writer.write(reply)

    def hang_up(self) -> None:
        for writer in self.writers:
            writer.close()
        self.server.close()


def refuse(message):
    return wire.channel_step([], [(message[1], wire.CoreRefused("full"))]) if message[0] == "add" else None


def serve(message):
    return wire.channel_step([output(message[1], "from the core", True)], []) if message[0] == "add" else None


def hold(message):
    return wire.channel_step([output(message[1], "started", False)], []) if message[0] == "add" else None


class RankingRouter:
    """The router's two calls the dispatch makes, over a real RouterState, with a fixed ranking."""

    def __init__(self, ranking: list[str]):
        self.ranking = ranking
        self.state = RouterState()

    def choose_for_dispatch(self, block_hashes):
        return Decision(self.ranking[0], FALLBACK, 0, rest=lambda: self.ranking[1:])

    def dispatched(self, request_id, replica_id, block_hashes, decision):
        return self.state.dispatched(request_id, replica_id, block_hashes, decision)[1]


class RayCall:
    """The request's Ray call: one output on the call's own stream."""

    def __init__(self, request_id: str):
        self.calls = 0
        self.request_id = request_id

    def __call__(self) -> FakeCall:
        self.calls += 1
        return FakeCall([RequestOutput.from_wire(output(self.request_id, "by Ray", True))])


async def connected(cores: dict[str, FakeCore], ranking: list[str]) -> OutputChannels:
    channels = OutputChannels(lambda request: None)
    channels.dispatch.enabled = True
    channels.dispatch._router = RankingRouter(ranking)
    for replica_id, core in cores.items():
        channels.met(replica_id, await core.start())
    for _ in range(200):
        if len(channels.links) == len(cores):
            return channels
        await asyncio.sleep(0.01)
    raise AssertionError("the channels did not open")


def stream(channels: OutputChannels, request_id: str) -> tuple[ReplicaStream, RayCall]:
    request = GenerateRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), None, [11])
    ray_call = RayCall(request_id)
    return ReplicaStream(ray_call, lambda exc: exc, channels, request_id, request=request), ray_call


async def texts(replica_stream: ReplicaStream) -> list[str]:
    return [out.outputs[0].text async for out in replica_stream]


def test_a_refusal_goes_down_the_ranking_and_the_router_counts_where_it_went():
    async def run():
        full, free = FakeCore(refuse), FakeCore(serve)
        channels = await connected({"full": full, "free": free}, ["full", "free"])
        s, ray_call = stream(channels, "r1")
        await s.prime()
        loads_during = dict(channels.dispatch._router.state.loads.loads)
        got = await texts(s)
        return full, free, ray_call, got, loads_during, channels.dispatch._router.state

    full, free, ray_call, got, loads_during, state = asyncio.run(run())
    assert got == ["from the core"] and ray_call.calls == 0
    assert [m[:2] for m in full.received] == [["add", "r1"]]
    assert [m[:2] for m in free.received] == [["add", "r1"]]
    assert free.received[0][2] == [1, 2, 3] and free.received[0][4] == [11]
    assert loads_during.get("free") == 1 and not loads_during.get("full")
    assert state.load("free") == 0  # released when it ended


def test_past_the_cores_with_a_channel_a_request_goes_by_ray():
    async def run():
        full = FakeCore(refuse)
        channels = await connected({"full": full}, ["full", "no-channel-yet"])
        s, ray_call = stream(channels, "r2")
        await s.prime()
        return ray_call, await texts(s), full

    ray_call, got, full = asyncio.run(run())
    assert got == ["by Ray"] and ray_call.calls == 1
    assert [m[0] for m in full.received] == ["add"]


def test_a_broken_channel_fails_exactly_its_requests_and_a_cancel_is_an_abort():
    async def run():
        a, b = FakeCore(hold), FakeCore(hold)
        channels = await connected({"a": a, "b": b}, ["a", "b"])
        on_a, _ = stream(channels, "on-a")
        await on_a.prime()
        channels.dispatch._router.ranking = ["b", "a"]
        on_b, _ = stream(channels, "on-b")
        await on_b.prime()
        a.hang_up()
        with pytest.raises(OpenAIError) as error:
            await texts(on_a)
        on_b.cancel()
        for _ in range(200):
            if b.received[-1][0] == "abort":
                break
            await asyncio.sleep(0.01)
        links = {replica_id: set(link.requests) for replica_id, link in channels.links.items()}
        b.hang_up()
        return error.value, b.received, links

    error, received_by_b, links = asyncio.run(run())
    assert error.status_code == 503 and "went away" in str(error)
    assert received_by_b[-1] == ["abort", ["on-b"]]
    assert links == {"b": set()}


async def sent_to_a_silent_core(request_id: str):
    """A request sent on the channel of core "a", which answers only when the test writes to it:
    (the core, the router's state, the request's stream, its priming task)."""
    core = FakeCore(lambda message: None)
    channels = await connected({"a": core}, ["a"])
    s, _ = stream(channels, request_id)
    primed = asyncio.get_running_loop().create_task(s.prime())
    for _ in range(200):
        if core.received:
            break
        await asyncio.sleep(0.01)
    return core, channels.dispatch._router.state, s, primed


def test_a_prompt_counts_as_queued_for_prefill_on_its_core_until_its_first_output():
    async def run():
        core, state, s, primed = await sent_to_a_silent_core("r1")
        queued_before = dict(state.loads.queued_prefill)
        core.writers[0].write(wire.channel_step([output("r1", "started", False)], []))
        await primed
        queued_after, load_after = dict(state.loads.queued_prefill), state.load("a")
        s.cancel()
        return queued_before, queued_after, load_after

    queued_before, queued_after, load_after = asyncio.run(run())
    assert queued_before == {"a": 1}  # the request's one block, which no replica was known to hold
    assert queued_after == {"a": 0} and load_after == 1  # prefilled, still in flight


def test_a_first_output_by_ray_is_reported_under_the_calls_id():
    async def run():
        channels = await connected({}, ["no-channel-yet"])
        seen = []
        channels.dispatch._router.state.first_output = seen.append
        s, ray_call = stream(channels, "r3")
        await s.prime()
        await texts(s)
        return seen, s.call_id, ray_call

    seen, call_id, ray_call = asyncio.run(run())
    assert ray_call.calls == 1 and call_id and seen == [call_id]


def test_a_cores_step_report_ends_the_requests_it_finished_and_sets_the_replicas_load():
    """A frame's step report reaches the router before the request's stream closes: the request
    that finished in that step ends as of it, and the replica's load is the reported one (other
    ingresses' requests included) from then on."""
    async def run():
        core, state, s, primed = await sent_to_a_silent_core("r1")
        sent_load = state.load("a")
        report = (time.time(), 3, 7, 0)  # three requests of other ingresses still there
        core.writers[0].write(wire.channel_step([output("r1", "done", True)], [], report))
        await primed
        reported_load = state.load("a")
        got = await texts(s)
        return sent_load, reported_load, state.load("a"), got

    sent_load, reported_load, final_load, got = asyncio.run(run())
    assert sent_load == 1 and got == ["done"]
    assert reported_load == 3 and final_load == 3  # its end took nothing off the report again
