"""The engine core in a process of its own (replicas/engine/core.py), reached as the ingress reaches
it (serve_app/engine_client.py): the same outputs as the engine in this process, errors that name
their field, aborts and lost connections that free every block, refusals past its limit that wait
in the ingress's queue, and a core that dies failing exactly the requests it held."""
from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.replicas.engine import cpu_binding, protocol
from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.engine.core_process import CoreProcess
from pagedserve.replicas.core.sampling_params import RequestOutputKind
from pagedserve.serve_app.errors import OpenAIError
from tests.core_harness import add_request, generate, running_core, started

GREEDY = dict(temperature=0, ignore_eos=True)


def config(model_dir: str, **overrides) -> EngineConfig:
    return EngineConfig(model=model_dir, max_model_len=256, dtype="float32", **overrides)


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def idle(core: CoreProcess) -> bool:
    stats = core.stats
    return stats["num_requests"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_core_streams_what_the_engine_makes_and_frees_what_it_aborts(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))
    params = SamplingParams(max_tokens=12, n=2, logprobs=1, **GREEDY)

    async def main():
        async with running_core(config(model_dir), in_process=False) as (core, client):
            prompt = core.tokenizer().encode("hello world")
            deltas = [out async for out in await started(
                client, "d", prompt, params.clone(output_kind=RequestOutputKind.DELTA))]
            finals = [out async for out in await started(
                client, "f", prompt, params.clone(output_kind=RequestOutputKind.FINAL_ONLY))]
            with pytest.raises(OpenAIError, match="maximum context length") as bad:
                await generate(client, "too-long", [3] * 300, params)
            stream = await started(client, "left", [5] * 40, params.clone(max_tokens=200))
            stream.cancel()  # a client that goes away
            await wait_until(lambda: idle(core))
            await wait_until(lambda: "core" in client.last_generation)  # a digest came
            # The digest's cached prefixes reached the router.
            assert client.router.index.replica_ids == {"core"}
            assert core.is_healthy() and core.pid != os.getpid()
            return deltas, finals, bad.value

    deltas, finals, bad = asyncio.run(main())
    whole = LLM(model_dir, max_model_len=256, dtype="float32").generate(
        "hello world", params, use_tqdm=False)[0]
    assert len(finals) == 1 and finals[0].finished
    assert [c.token_ids for c in finals[0].outputs] == [c.token_ids for c in whole.outputs]
    for index, want in enumerate(whole.outputs):
        mine = [c for d in deltas for c in d.outputs if c.index == index]
        assert [t for c in mine for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in mine) == want.text
        assert [p for c in mine for p in c.logprobs] == want.logprobs
    assert bad.status_code == 400 and bad.param == "prompt"


def test_past_its_limit_the_core_refuses_and_the_request_waits_its_turn(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))
    long = SamplingParams(max_tokens=60, **GREEDY)

    async def main():
        # A slowed engine: the first request is still running when the second arrives.
        async with running_core(config(model_dir), max_requests=1,
                                engine_class="tests.serve.slow_engine:SlowEngine") as (core, client):
            first = await started(client, "first", [5] * 20, long)
            second = asyncio.ensure_future(generate(client, "second", [6] * 20, long))
            await wait_until(lambda: len(client.waiting) == 1)  # refused: queued here
            assert core.stats["num_requests"] <= 1
            whole = [out async for out in first]
            done = await second  # served once the first finished
            client.max_queued_requests = 0
            third = await started(client, "third", [5] * 20, long)
            with pytest.raises(OpenAIError) as full:  # no room, and no room to wait
                await generate(client, "fourth", [7] * 20, long)
            third.cancel()
            return whole, done, full.value

    whole, done, full = asyncio.run(main())
    assert whole[-1].finished and len(done.outputs[0].token_ids) == 60
    assert full.status_code == 429 and full.retry_after_s == 1


def test_a_client_that_goes_away_frees_its_requests_and_only_its_own_abort_counts(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))

    async def main():
        async with running_core(config(model_dir),
                                engine_class="tests.serve.slow_engine:VerySlowEngine") as (core,
                                                                                           client):
            host, port, token = core.address
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(protocol.frame(protocol.Hello(protocol.PROTOCOL_VERSION, token, "other")))
            writer.write(protocol.frame(add_request("theirs", [5] * 30,
                                                    SamplingParams(max_tokens=200, **GREEDY))))
            await wait_until(lambda: core.stats["num_requests"] == 1)
            mine = await started(client, "mine", [6] * 10, SamplingParams(max_tokens=8, **GREEDY))
            client.links["core"].writer.write(protocol.frame(protocol.Abort(["theirs"])))
            async for _ in mine:  # the abort above was not its to send: "theirs" runs on
                pass
            await wait_until(lambda: core.stats["num_requests"] == 1)
            await asyncio.sleep(0.3)
            assert core.stats["num_requests"] == 1
            writer.close()  # it goes away: its request goes with it
            await wait_until(lambda: idle(core))

    asyncio.run(main())


@pytest.mark.parametrize("hello", [
    protocol.Hello(protocol.PROTOCOL_VERSION, "0" * 32, "x"),  # not the core's token
    protocol.Hello(protocol.PROTOCOL_VERSION + 1, None, "x"),  # another protocol
    protocol.Abort(["x"]),  # no hello at all
])
def test_a_client_without_the_token_and_the_protocol_is_dropped(tiny_model_dir, hello):
    async def main():
        async with running_core(config(str(tiny_model_dir("llama")))) as (core, _):
            host, port, token = core.address
            if isinstance(hello, protocol.Hello) and hello.token is None:
                hello.token = token
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(protocol.frame(hello))
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing sent
            writer.close()

    asyncio.run(main())


def test_an_idle_core_keeps_sending_stats_until_its_load_has_faded(tiny_model_dir):
    """The autoscaler reads a replica's load from the core's last stats: a core that went idle
    must not leave its busy figure there for good."""
    from pagedserve.replicas.core.step_load import DEFAULT_WINDOW_S

    model_dir = str(tiny_model_dir("llama"))

    async def main():
        async with running_core(config(model_dir), in_process=False) as (core, client):
            # Eight at once, ending together: every step computes several tokens, so the load
            # reads above the fixed cost of a step.
            await asyncio.gather(*(generate(client, f"r{i}", [5] * 40, SamplingParams(
                max_tokens=64, **GREEDY)) for i in range(8)))
            await wait_until(lambda: core.stats["num_generation_tokens"] == 8 * 64
                             and core.stats["num_requests"] == 0)
            busy = core.stats["compute_utilization"]
            await wait_until(lambda: core.stats["compute_utilization"] == 0,
                             timeout_s=DEFAULT_WINDOW_S + 5)
            return busy

    assert asyncio.run(main()) > 0


def test_a_core_that_dies_fails_the_requests_it_held(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))

    async def main():
        async with running_core(config(model_dir), in_process=False) as (core, client):
            stream = await started(client, "held", [5] * 8, SamplingParams(max_tokens=200, **GREEDY))
            os.kill(core.pid, signal.SIGKILL)
            with pytest.raises(OpenAIError, match="went away") as gone:
                async for _ in stream:
                    pass
            assert gone.value.status_code == 503
            await wait_until(lambda: not core.is_healthy())
            assert "exited" in str(core.error)

    asyncio.run(main())


def test_the_core_runs_on_the_cpus_it_claimed_and_gives_them_back(tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    claims = tmp_path / "cpus.json"
    monkeypatch.setenv("PAGEDSERVE_CPU_CLAIMS", str(claims))  # the core's, as read at its import
    monkeypatch.setattr(cpu_binding, "CLAIMS_PATH", claims)
    model_dir = str(tiny_model_dir("llama"))
    ours = sorted(os.sched_getaffinity(0))
    for spec, bound in (("auto", ours[-1:]), (str(ours[0]), ours[:1])):  # "off": a unit test's
        start = protocol.Start(config(model_dir, num_threads=1, cpu_bind=spec).model_dump(),
                               "127.0.0.1")
        core = CoreProcess(start)
        try:
            threads = {tuple(sorted(os.sched_getaffinity(int(tid))))
                       for tid in os.listdir(f"/proc/{core.pid}/task")}
            assert threads == {tuple(bound)}, spec
            assert core.stats["engine_cpus"] == bound
            assert cpu_binding.engine_cpus() == set(bound)
        finally:
            core.shutdown()
        assert cpu_binding.engine_cpus() == set()  # released as it stopped


def test_the_core_freezes_its_startup_heap(tiny_model_dir):
    """A full collection while serving walks only what serving made, not the model, tokenizer and
    libraries the core was built with (see replicas/engine/core.py: serve)."""
    core = CoreProcess(protocol.Start(config(str(tiny_model_dir("llama"))).model_dump(),
                                      "127.0.0.1"))
    try:
        assert core.info["gc_frozen_objects"] > 10_000
    finally:
        core.shutdown()


def test_a_core_that_cannot_load_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="engine failed to start"):
        CoreProcess(protocol.Start(EngineConfig(model=str(tmp_path)).model_dump(), "127.0.0.1"))


def test_a_draining_core_refuses_new_requests_and_finishes_what_it_holds(tiny_model_dir):
    async def main():
        async with running_core(config(str(tiny_model_dir("llama")))) as (core, client):
            held = await started(client, "held", [5] * 8, SamplingParams(max_tokens=40, **GREEDY))
            drained = asyncio.ensure_future(core.drain(30))
            await wait_until(lambda: client.links["core"].draining)
            with pytest.raises(OpenAIError) as refused:  # nowhere else to go
                await generate(client, "late", [6] * 8, SamplingParams(max_tokens=4, **GREEDY))
            whole = [out async for out in held]
            assert await drained and whole[-1].finished
            return refused.value

    assert asyncio.run(main()).status_code == 503


def test_sockets_close_with_the_core(tiny_model_dir):
    core = CoreProcess(protocol.Start(config(str(tiny_model_dir("llama"))).model_dump(),
                                      "127.0.0.1"))
    host, port, _ = core.address
    core.shutdown()
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=2)


class HangingEngine:
    """An LLMEngine whose steps hang while it holds a request whose id starts with "hang", until
    `release` is set: a wedged device, as the replica's stall check must see it."""

    release = None  # a threading.Event, set by the test

    def __new__(cls, config):
        from pagedserve.replicas.engine.llm_engine import LLMEngine

        class Hanging(LLMEngine):
            def step(self):
                if any(r.startswith("hang") for r in self.requests):
                    HangingEngine.release.wait(30)
                return super().step()
        return Hanging(config)


def test_a_core_whose_first_step_hangs_has_told_its_replica_it_has_work(tiny_model_dir):
    """The replica's stall check reads the core's stats: the stats that show a request must leave
    before the step that hangs on it, or an idle-looking core would never be replaced."""
    import threading

    HangingEngine.release = threading.Event()

    async def main():
        async with running_core(config(str(tiny_model_dir("llama"))),
                                engine_class=f"{__name__}:HangingEngine") as (core, client):
            await wait_until(lambda: core.stats["num_requests"] == 0)
            steps = core.stats["num_steps"]
            stream = asyncio.ensure_future(generate(client, "hang-1", [5] * 8,
                                                    SamplingParams(max_tokens=4, **GREEDY)))
            await wait_until(lambda: core.stats["num_requests"] == 1, timeout_s=3)
            assert core.stats["num_steps"] == steps  # it is stuck in its first step
            HangingEngine.release.set()
            assert len((await stream).outputs[0].token_ids) == 4

    asyncio.run(main())


class GrowingDirectory:
    """The `CoreDirectory` handle's `watch.remote(version)` over cores published while it runs."""

    def __init__(self):
        self.entries: dict[str, list] = {}
        self.version = 0
        self.changed = asyncio.Event()
        self.watch = self

    async def remote(self, version: int):
        while version == self.version:
            self.changed.clear()
            await self.changed.wait()
        return self.version, dict(self.entries), {}

    def publish(self, replica_id: str, address) -> None:
        self.entries[replica_id] = list(address)
        self.version += 1
        self.changed.set()


def test_with_no_core_up_and_scale_from_zero_requests_wait_and_ask_for_one_replica(
        tiny_model_dir):
    """min_replicas=0: with no core up, requests wait (no 503) and the ingress asks Ray Serve for
    a replica once, however many wait; the core that then joins serves them."""
    from pagedserve.serve_app.engine_client import EngineClient
    from pagedserve.serve_app.routing.policy import RoutingSettings

    engine_config = config(str(tiny_model_dir("llama")), num_kv_blocks=32)
    greedy = SamplingParams(max_tokens=4, **GREEDY)
    started_cores: list[CoreProcess] = []

    async def run():
        directory = GrowingDirectory()
        asks = []

        async def ask_for_replica():  # what Ray Serve's autoscaler then does: start one
            asks.append(1)
            start = protocol.Start(engine_config.model_dump(), "127.0.0.1", None, None, None)
            core = await asyncio.to_thread(CoreProcess, start, True)
            started_cores.append(core)
            core.attach()
            directory.publish("core", core.address)

        client = EngineClient(directory, RoutingSettings(), -1, retry_after_s=1,
                              ask_for_replica=ask_for_replica)
        client.scale_from_zero = True
        client.cold_start_wait_s = 60.0
        client.start()
        try:
            outputs = await asyncio.gather(generate(client, "a", [5, 6, 7], greedy),
                                           generate(client, "b", [8, 9], greedy))
        finally:
            client.shutdown()
        return asks, outputs

    try:
        asks, outputs = asyncio.run(run())
    finally:
        for core in started_cores:
            core.shutdown()
    assert asks == [1]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]


def test_with_no_core_up_and_no_scale_from_zero_nothing_is_asked_for(tiny_model_dir):
    from pagedserve.serve_app.engine_client import EngineClient
    from pagedserve.serve_app.routing.policy import RoutingSettings

    async def run():
        asks = []

        async def ask_for_replica():
            asks.append(1)

        client = EngineClient(GrowingDirectory(), RoutingSettings(), -1, retry_after_s=1,
                              ask_for_replica=ask_for_replica)
        client.no_core_wait_s = 0.2
        client.start()
        try:
            with pytest.raises(OpenAIError) as error:
                await generate(client, "a", [5, 6, 7], SamplingParams(max_tokens=2))
        finally:
            client.shutdown()
        return asks, error.value

    asks, error = asyncio.run(run())
    assert asks == [] and error.status_code == 503
