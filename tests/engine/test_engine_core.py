"""The engine core in a process of its own (replicas/engine_core.py) behind EngineCoreClient: the
same outputs as the engine in this process, errors that name their field, aborts that free every
block, a routing report made where the KV-event log is, and a core that dies failing exactly the
requests it held."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from replicas import LLM, SamplingParams
from replicas import core_wire as wire
from replicas import cpu_binding
from replicas.config import EngineConfig
from replicas.engine_client import EngineDeadError
from replicas.engine_core_client import EngineCoreClient
from replicas.sampling_params import ParamError, RequestOutputKind

GREEDY = dict(temperature=0, ignore_eos=True)


def config(model_dir: str, **overrides) -> EngineConfig:
    return EngineConfig(model=model_dir, max_model_len=256, dtype="float32", **overrides)


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_frames_split_across_reads_come_out_whole():
    reader = wire.FrameReader()
    data = wire.frame((wire.STEP, [1, 2], [], None)) + wire.frame((wire.REPLY, 7, True, {"a": 1}))
    got = []
    for i in range(0, len(data), 5):
        got += reader.feed(data[i:i + 5])
    assert got == [(wire.STEP, [1, 2], [], None), (wire.REPLY, 7, True, {"a": 1})]


def test_an_unpicklable_error_still_crosses_as_its_message():
    class Local(Exception):
        pass

    assert isinstance(wire.portable(ParamError("n", "bad")), ParamError)
    crossed = wire.portable(Local("what went wrong"))
    assert type(crossed) is RuntimeError and "what went wrong" in str(crossed)


def test_the_core_streams_what_the_engine_makes_and_frees_what_it_aborts(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=12, n=2, logprobs=1, **GREEDY)

    async def main():
        client = EngineCoreClient(config(model_dir))
        try:
            deltas = [out async for out in client.generate(
                "hello world", params.clone(output_kind=RequestOutputKind.DELTA), "d")]
            finals = [out async for out in client.generate(
                "hello world", params.clone(output_kind=RequestOutputKind.FINAL_ONLY), "f")]
            with pytest.raises(ParamError, match="maximum context length") as bad:
                async for _ in client.generate([3] * 300, params, "too-long"):
                    pass
            stream = client.generate([5] * 40, params.clone(max_tokens=200), "left")
            await stream.__anext__()
            await stream.aclose()  # a client that goes away
            await wait_until(lambda: client.stats()["num_requests"] == 0)
            stats = client.stats()
            report = await client.routing_report(force_snapshot=True)
            assert client.is_healthy()
            return deltas, finals, bad.value, stats, report
        finally:
            client.shutdown()

    deltas, finals, bad, stats, report = asyncio.run(main())
    whole = LLM(model_dir, max_model_len=256, dtype="float32").generate(
        "hello world", params, use_tqdm=False)[0]
    assert len(finals) == 1 and finals[0].finished
    assert [c.token_ids for c in finals[0].outputs] == [c.token_ids for c in whole.outputs]
    for index, want in enumerate(whole.outputs):
        mine = [c for d in deltas for c in d.outputs if c.index == index]
        assert [t for c in mine for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in mine) == want.text
        assert [p for c in mine for p in c.logprobs] == want.logprobs
    assert bad.param is not None
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["max_num_seqs"] > 0
    assert report["kv_events"]["snapshot"]["block_hashes"]  # the prompt's full blocks stay cached
    assert report["num_running"] == 0


def test_an_idle_core_keeps_sending_stats_until_its_load_has_faded(tiny_model_dir):
    """The autoscaler reads a replica's load from the core's last stats: a core that went idle
    must not leave its busy figure there for good."""
    from replicas.step_load import DEFAULT_WINDOW_S

    model_dir = str(tiny_model_dir("llama"))

    async def drain(stream):
        async for _ in stream:
            pass

    async def main():
        client = EngineCoreClient(config(model_dir))
        try:
            # Eight at once, ending together: every step computes several tokens, so the load
            # reads above the fixed cost of a step (alone, every decode step is the lightest
            # kind, which defines that cost, and the load could read 0 on a tiny model).
            await asyncio.gather(*(drain(client.generate([5] * 40, SamplingParams(
                max_tokens=64, **GREEDY), f"r{i}")) for i in range(8)))
            await wait_until(lambda: client.stats()["num_requests"] == 0)
            busy = client.stats()["compute_utilization"]
            await wait_until(lambda: client.stats()["compute_utilization"] == 0,
                             timeout_s=DEFAULT_WINDOW_S + 5)
            return busy
        finally:
            client.shutdown()

    assert asyncio.run(main()) > 0


def test_a_core_that_dies_fails_the_requests_it_held(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))

    async def main():
        client = EngineCoreClient(config(model_dir))
        stream = client.generate("hello", SamplingParams(max_tokens=10_000 // 50, **GREEDY), "held")
        await stream.__anext__()
        os.kill(client._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in stream:
                pass
        assert not client.is_healthy()
        with pytest.raises(EngineDeadError):
            client.add_request("next", "hello", None, lambda item: None)
        client.shutdown()

    asyncio.run(main())


def test_the_core_runs_on_the_cpus_it_claimed_and_gives_them_back(tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    claims = tmp_path / "cpus.json"
    monkeypatch.setenv("PAGEDSERVE_CPU_CLAIMS", str(claims))  # the core's, as read at its import
    monkeypatch.setattr(cpu_binding, "CLAIMS_PATH", claims)
    model_dir = str(tiny_model_dir("llama"))
    ours = sorted(os.sched_getaffinity(0))
    for spec, bound in (("auto", ours[-1:]), (str(ours[0]), ours[:1])):  # "off": a unit test's
        client = EngineCoreClient(config(model_dir, num_threads=1, cpu_bind=spec))
        try:
            pid = client.stats()["engine_pid"]
            threads = {tuple(sorted(os.sched_getaffinity(int(tid))))
                       for tid in os.listdir(f"/proc/{pid}/task")}
            assert threads == {tuple(bound)}, spec
            assert client.stats()["engine_cpus"] == bound
            assert cpu_binding.engine_cpus() == set(bound)
        finally:
            client.shutdown()
        assert cpu_binding.engine_cpus() == set()  # released as it stopped (or dropped: it is gone)


def test_the_core_freezes_its_startup_heap(tiny_model_dir):
    """A full collection while serving walks only what serving made, not the model, tokenizer and
    libraries the core was built with (see replicas/engine_core.py: main)."""
    client = EngineCoreClient(config(str(tiny_model_dir("llama"))))
    try:
        assert client.gc_frozen_objects > 10_000
    finally:
        client.shutdown()


def test_a_core_that_cannot_load_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="engine failed to start"):
        EngineCoreClient(EngineConfig(model=str(tmp_path)))


def test_a_connected_channel_carries_the_outputs_and_the_replica_hears_only_the_end(tiny_model_dir):
    import socket

    from replicas.engine_core_client import DeliveredOnChannel
    from replicas.output_channel import ChannelClosed
    from replicas.outputs import RequestOutput

    model_dir = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=12, output_kind=RequestOutputKind.DELTA, **GREEDY)
    channel_id = "c" * wire.CHANNEL_ID_BYTES

    async def read_outputs(sock: socket.socket, request_id: str) -> list[RequestOutput]:
        reader, got = wire.FrameReader(), []
        loop = asyncio.get_running_loop()
        while not (got and got[-1].finished):
            data = await loop.sock_recv(sock, 1 << 16)
            assert data, "the channel closed"
            got += [RequestOutput.from_wire(v) for _, batch, _, _ in reader.feed(data) for v in batch
                    if v[0] == request_id]
        return got

    async def main():
        client = EngineCoreClient(config(model_dir))
        try:
            host, port, token = await client.open_channels("127.0.0.1")
            # Before any ingress connects, a request naming the channel streams to the replica.
            before = [out async for out in client.generate("hello world", params, "before",
                                                           channel_id=channel_id)]
            stranger = socket.create_connection((host, port))
            stranger.sendall(wire.channel_hello("0" * wire.CHANNEL_TOKEN_BYTES, channel_id))
            assert stranger.recv(16) == b""  # a wrong token is hung up on
            sock = socket.create_connection((host, port))
            sock.setblocking(False)
            sock.sendall(wire.channel_hello(token, channel_id))
            await wait_until(lambda: client.stats()["core_channels"] == 1)
            stream = client.generate("hello world", params, "routed", channel_id=channel_id)
            reading = asyncio.ensure_future(read_outputs(sock, "routed"))
            with pytest.raises(DeliveredOnChannel):
                async for _ in stream:
                    pass
            routed = await reading
            # A channel that goes away fails its requests; their blocks are freed.
            held = client.generate([5] * 20, params.clone(max_tokens=230), "held",
                                   channel_id=channel_id)
            first = asyncio.ensure_future(held.__anext__())
            assert await asyncio.get_running_loop().sock_recv(sock, 1 << 16)  # it streams ...
            sock.close()  # ... and its ingress goes away
            with pytest.raises(ChannelClosed):
                await first
            await wait_until(lambda: client.stats()["num_requests"] == 0)
            stats = client.stats()
            return before, routed, stats
        finally:
            client.shutdown()

    before, routed, stats = asyncio.run(main())
    assert [t for o in routed for c in o.outputs for t in c.token_ids] == \
        [t for o in before for c in o.outputs for t in c.token_ids]
    assert len(routed) > 1 and routed[-1].finished
    assert stats["core_channel_outputs"] >= len(routed)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["core_channels"] == 0


def test_requests_sent_on_a_channel_come_back_on_it_within_the_replicas_limit(tiny_model_dir):
    """An ingress may send requests on its channel: the same tokens as by the replica, refused
    past max_ongoing_requests or while draining, errors naming their field, its own aborts (and
    its going away) freeing every block."""
    import socket

    from replicas.outputs import RequestOutput

    model_dir = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=12, output_kind=RequestOutputKind.DELTA, **GREEDY)
    channel_id = "d" * wire.CHANNEL_ID_BYTES
    prompt = [3, 14, 15, 92, 65, 35]

    class Channel:
        def __init__(self, host, port, token):
            self.sock = socket.create_connection((host, port))
            self.sock.setblocking(False)
            self.sock.sendall(wire.channel_hello(token, channel_id))
            self.reader = wire.FrameReader()
            self.outputs: dict[str, list[RequestOutput]] = {}
            self.errors: dict[str, BaseException] = {}
            self.final_reports: dict[str, tuple] = {}  # the step report with a request's end

        def add(self, request_id, params, token_ids=prompt):
            self.sock.sendall(wire.channel_add(request_id, token_ids, None, None, params, 0))

        async def until(self, request_id):
            """Read until request_id has finished or failed."""
            loop = asyncio.get_running_loop()
            while not (request_id in self.errors or (self.outputs.get(request_id)
                                                     and self.outputs[request_id][-1].finished)):
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 1 << 16), 30)
                assert data, "the channel closed"
                for _, batch, failures, report in self.reader.feed(data):
                    for values in batch:
                        self.outputs.setdefault(values[0], []).append(
                            RequestOutput.from_wire(values))
                        if RequestOutput.finished_on_wire(values):
                            self.final_reports[values[0]] = report
                    self.errors.update(failures)

    async def main():
        client = EngineCoreClient(config(model_dir))
        try:
            host, port, token = await client.open_channels("127.0.0.1", max_ongoing_requests=1)
            by_replica = [out async for out in client.generate(prompt, params, "by-replica")]
            channel = Channel(host, port, token)
            sent_at = time.time()
            channel.add("direct", params)
            await channel.until("direct")
            assert sent_at <= channel.final_reports["direct"][0] <= time.time()
            # One request held: a second is refused, and goes elsewhere.
            channel.add("long", params.clone(max_tokens=200))
            channel.add("second", params)
            await channel.until("second")
            channel.sock.sendall(wire.channel_abort(["long"]))
            await wait_until(lambda: client.stats()["num_requests"] == 0)
            channel.add("bad", params, token_ids=[10 ** 6])
            await channel.until("bad")
            channel.add("held", params.clone(max_tokens=240))
            loop = asyncio.get_running_loop()
            assert await asyncio.wait_for(loop.sock_recv(channel.sock, 1 << 16), 30)  # it streams
            channel.sock.close()  # its ingress went away: nobody reads it
            await wait_until(lambda: client.stats()["num_requests"] == 0)
            assert await client.drain(5.0)
            late = Channel(host, port, token)
            late.add("late", params)
            await late.until("late")
            return by_replica, channel, late, client.stats()
        finally:
            client.shutdown()

    by_replica, channel, late, stats = asyncio.run(main())
    tokens = lambda outs: [t for o in outs for c in o.outputs for t in c.token_ids]  # noqa: E731
    assert tokens(channel.outputs["direct"]) == tokens(by_replica) and len(tokens(by_replica)) == 12
    # Its last step's report, for the ingress's router: none left waiting or running (it has
    # finished), two arrived (it and the one by the replica), nothing left to prefill.
    assert channel.final_reports["direct"][1:] == (0, 2, 0)
    assert isinstance(channel.errors["second"], wire.CoreRefused)
    assert channel.errors["second"].reason == "full"
    assert "long" not in channel.errors and not channel.outputs["long"][-1].finished
    assert isinstance(channel.errors["bad"], ParamError) and channel.errors["bad"].param == "prompt"
    assert late.errors["late"].reason == "draining"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_sampling_params_cross_a_channel_as_json_intact():
    from replicas.sampling_params import StructuredOutputsParams

    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["x"],
                            logit_bias={7: -1.5}, logprobs=2, max_tokens=9,
                            output_kind=RequestOutputKind.FINAL_ONLY,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"},
                                                                       source="response_format"))
    import json
    again = wire.params_from_json(json.loads(json.dumps(wire.params_to_json(params))))
    assert again == params and again.structured_outputs.source == "response_format"
    with pytest.raises(TypeError):
        wire.params_from_json({"eos_token_ids": [1]})
    with pytest.raises(ParamError):
        wire.params_from_json({"top_p": 2.0})


def test_past_the_limit_requests_by_the_replica_wait_in_order_and_channels_are_refused(
        tiny_model_dir):
    """A request by Ray past max_ongoing_requests waits in the core (its call keeps its Ray
    slot, so Ray queues those after it) and starts as room frees; meanwhile a request on a
    channel is refused: the limit counts both ways in."""
    import socket

    model_dir = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=200, output_kind=RequestOutputKind.DELTA, **GREEDY)
    channel_id = "e" * wire.CHANNEL_ID_BYTES

    async def main():
        client = EngineCoreClient(config(model_dir))
        try:
            host, port, token = await client.open_channels("127.0.0.1", max_ongoing_requests=1)
            sock = socket.create_connection((host, port), timeout=30)
            sock.sendall(wire.channel_hello(token, channel_id))
            finished = []

            async def run(request_id):
                async for out in client.generate([7, 8, 9], params, request_id):
                    if out.finished:
                        finished.append(request_id)

            first = asyncio.ensure_future(run("first"))
            second = asyncio.ensure_future(run("second"))
            await wait_until(lambda: client.stats()["num_waiting"] == 1)
            sock.sendall(wire.channel_add("direct", [7, 8, 9], None, None, params, 0))
            reader, refusals = wire.FrameReader(), {}
            while not refusals:
                data = await asyncio.get_running_loop().run_in_executor(None, sock.recv, 1 << 16)
                for _, _, failures, _ in reader.feed(data):
                    refusals.update(failures)
            await asyncio.gather(first, second)
            sock.close()
            return finished, refusals, client.stats()
        finally:
            client.shutdown()

    finished, refusals, stats = asyncio.run(main())
    assert finished == ["first", "second"]
    assert refusals["direct"].reason == "full"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_requests"] == 0
