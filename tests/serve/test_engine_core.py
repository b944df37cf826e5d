"""Engine replicas whose engine steps in a process of its own (the default), over real Ray Serve
and HTTP: a core that dies mid-stream ends exactly the streams it held with an error event, and
Ray Serve replaces the replica; `engine_process=false` serves the same tokens from a thread."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import psutil
import pytest

from bench.common import free_port
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, deploy, replica_stats, wait_for

GREEDY = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def apps(cluster, tiny_model_dir):
    from ray import serve
    urls = {}
    for name, engine_process in (("core", True), ("thread", False)):
        port = free_port()
        deploy(dict(model=tiny_model_dir, num_replicas=1, replica_num_cpus=0.5,
                    health_check_period_s=1.0, direct_http=True, port=port,
                    engine_process=engine_process, **ENGINE_ARGS), name, f"/{name}")
        urls[name] = f"http://127.0.0.1:{port}"
    yield urls
    for name in urls:
        serve.delete(name)


def test_the_engine_in_a_thread_serves_the_same_tokens(apps):
    body = {**GREEDY, "prompt": "the engine core", "max_tokens": 24}
    texts = {name: httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
             ["choices"][0]["text"] for name, url in apps.items()}
    assert texts["core"] == texts["thread"] and texts["core"]
    (stats,) = replica_stats("core", 1).values()
    assert stats["engine_pid"] != os.getpid() and stats["num_generation_tokens"] >= 24


def test_the_core_runs_on_the_cpus_it_claimed_and_its_ingress_keeps_off_them(apps):
    from pagedserve.replicas.engine import cpu_binding
    body = {**GREEDY, "prompt": "on which cpus", "max_tokens": 4}
    assert httpx.post(f"{apps['core']}/v1/completions", json=body, timeout=60).status_code == 200
    (stats,) = replica_stats("core", 1).values()
    ours = set(os.sched_getaffinity(0))
    claimed = cpu_binding.engine_cpus()  # every core's on this node: the main app's too
    # auto binds only where enough CPUs were free when the core started (the main app's two
    # cores may hold both of a 2-CPU machine's): then it holds what it claimed, else nothing.
    cpus = set(stats["engine_cpus"])
    assert cpus <= claimed
    threads = {frozenset(os.sched_getaffinity(int(tid)))
               for tid in os.listdir(f"/proc/{stats['engine_pid']}/task")}
    assert threads == {frozenset(cpus or ours)}
    ingress = [p.pid for p in psutil.process_iter(["cmdline"])
               if (p.info["cmdline"] or [""])[0].startswith("ray::ServeReplica:core:Ingress")]
    assert ingress, "the core app's ingress replica process"
    # It has opened its channel to the core (the request above): off every claimed CPU, or on
    # all where the cores hold every one.
    assert set(os.sched_getaffinity(ingress[0])) == (ours - claimed or ours)


def test_a_dead_engine_core_fails_its_streams_and_the_replica_is_replaced(apps):
    url = apps["core"]
    body = {**GREEDY, "max_tokens": 480, "stream": True}

    async def one(http, i, started):
        outcome = {"error": None, "done": False}
        async with http.stream("POST", "/v1/completions",
                               json={**body, "prompt": f"stream {i}"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                data = line[len("data: "):] if line.startswith("data: ") else None
                if data == "[DONE]":
                    outcome["done"] = True
                elif data:
                    event = json.loads(data)
                    outcome["error"] = event.get("error", outcome["error"])
                    started.add(i)
        return outcome

    async def run(pid):
        started: set[int] = set()
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            tasks = [asyncio.create_task(one(http, i, started)) for i in range(4)]
            while len(started) < 4:
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    (before,) = replica_stats("core", 1).values()
    outcomes = asyncio.run(run(before["engine_pid"]))
    for o in outcomes:
        assert o["done"] and o["error"] is not None, outcomes
        assert o["error"]["code"] == "service_unavailable", o

    def replaced():
        r = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": "again", "max_tokens": 4},
                       timeout=30)
        return r.status_code == 200

    wait_for(replaced, 90, 0.5, "a replacement replica to serve")
    (after,) = replica_stats("core", 1).values()
    assert after["replica_id"] != before["replica_id"] and after["healthy"]
