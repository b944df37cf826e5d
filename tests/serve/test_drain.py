"""Replicas leave without cutting a stream. 32 streams that run ~24 s (longer than Ray Serve's
default 20 s drain) are in flight on 2 engine replicas while (1) the config's `deployments:` entry
for EngineReplica changes `num_replicas` to 1 (Ray Serve's in-place update: nothing restarts),
(2) the autoscaler scales down to 1 (its bounds changed in place the same way), and (3) the app's
`args` change an engine setting (a new version: every replica is replaced and the old ones drain).
Each time every stream ends with all its tokens, and requests sent meanwhile are served. And a
stream that outlives the drain timeout of a removed engine replica ends with an error event.
The apps are deployed from a config, as `serve deploy` and KubeRay do."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, wait_for

pytestmark = pytest.mark.long

APP = "drain"
PREFIX = "/drain"
NUM_STREAMS = 32
MAX_TOKENS = 240  # ~24 s at 100 ms a step; 32 of them fit one replica's KV cache


def _deploy(tiny_model_dir: str, blocking: bool = True, engine_replica: dict | None = None,
            **changes) -> None:
    """Deploy the app; `engine_replica`: the config's `deployments:` entry for EngineReplica (the
    options Ray Serve changes in place), `changes`: the app's `args` (any change: a new version)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    args = dict(model=tiny_model_dir, num_replicas=2, replica_num_cpus=0.25,
                graceful_shutdown_timeout_s=90, health_check_period_s=1.0,
                engine_class="tests.serve.slow_engine:VerySlowEngine",
                **{**ENGINE_ARGS, "num_kv_blocks": 640})
    args.update(changes)
    app = {"name": APP, "route_prefix": PREFIX, "import_path": "serve_app:app", "args": args}
    if engine_replica:
        app["deployments"] = [{"name": "EngineReplica", **engine_replica}]
    config = {"applications": [app]}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config), _blocking=blocking)


def _replica_names() -> list[str]:
    import ray
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if f"{APP}#" in a["name"])


def _running_replicas() -> int | None:
    from ray import serve
    app = serve.status().applications.get(APP)
    deployment = app.deployments.get("EngineReplica") if app else None
    if deployment is None:  # the config is still being applied
        return None
    return {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}.get("RUNNING", 0)


async def _stream(http: httpx.AsyncClient) -> tuple[int, list[str]]:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return response.status_code, events


def _check_complete(results) -> None:
    cut = []
    for status, events in results:
        usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
        errors = [e for e in events[:-1] if "error" in json.loads(e)]
        if status != 200 or errors or not usage or usage[-1]["completion_tokens"] != MAX_TOKENS \
                or events[-1] != "[DONE]":
            cut.append((status, errors[:1], usage[-1:]))
    assert not cut, f"{len(cut)} of {len(results)} streams were cut: {cut[:3]}"


async def _streams_through(base_url: str, change) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=180) as http:
        streams = [asyncio.create_task(_stream(http)) for _ in range(NUM_STREAMS)]
        await asyncio.sleep(4)  # all started, on both replicas
        assert not any(s.done() for s in streams)
        await asyncio.to_thread(change)
        assert not all(s.done() for s in streams), "the change took effect only after the streams"
        extra = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                                          "max_tokens": 4})
        assert extra.status_code == 200, extra.text  # served by a replica that stays
        _check_complete(await asyncio.gather(*streams))


@pytest.fixture(scope="module")
def drain_app(cluster, tiny_model_dir):
    yield f"{cluster.base_url}{PREFIX}"
    from ray import serve
    serve.delete(APP)


def test_scaling_down_in_place_cuts_no_stream(drain_app, tiny_model_dir):
    _deploy(tiny_model_dir)
    wait_for(lambda: _running_replicas() == 2, 60, 0.5, "2 replicas")
    before = _replica_names()

    def scale_down():
        _deploy(tiny_model_dir, blocking=False, engine_replica={"num_replicas": 1})
        wait_for(lambda: _running_replicas() == 1, 30, 0.2, "1 replica running")
    asyncio.run(_streams_through(drain_app, scale_down))
    wait_for(lambda: len(_replica_names()) == len(before) - 1, 90, 0.5, "the drained replica gone")
    assert set(_replica_names()) < set(before), "nothing restarted: the others stay"


def test_autoscaling_down_cuts_no_stream(drain_app, tiny_model_dir):
    from pagedserve.serve_app.autoscaling import autoscaling_config

    def bounds(num_replicas: int) -> dict:
        return {"autoscaling_config": autoscaling_config(
            min_replicas=num_replicas, max_replicas=num_replicas, initial_replicas=num_replicas,
            target_queue_depth=4, downscale_delay_s=1)}
    _deploy(tiny_model_dir, engine_replica=bounds(2))
    wait_for(lambda: _running_replicas() == 2, 60, 0.5, "2 replicas")
    before = _replica_names()

    def let_it_scale_down():
        # The autoscaler's bound, not its policy: 32 streams would fill one replica's sequence
        # slots past the policy's target load, so the policy itself keeps two.
        _deploy(tiny_model_dir, blocking=False, engine_replica=bounds(1))
        wait_for(lambda: _running_replicas() == 1, 20, 0.2, "the autoscaler to scale down")
    asyncio.run(_streams_through(drain_app, let_it_scale_down))
    wait_for(lambda: len(_replica_names()) == len(before) - 1, 90, 0.5, "the drained replica gone")
    assert set(_replica_names()) < set(before), "nothing restarted: the others stay"


def test_a_new_engine_version_drains_the_old_replicas(drain_app, tiny_model_dir):
    _deploy(tiny_model_dir)
    wait_for(lambda: _running_replicas() == 2, 60, 0.5, "2 replicas")

    def new_version():
        # An engine setting: new replicas start, then the old ones drain.
        _deploy(tiny_model_dir, blocking=False, seed=1)
        time.sleep(2)
    asyncio.run(_streams_through(drain_app, new_version))


def test_a_stream_outliving_the_drain_timeout_ends_with_an_error_event(drain_app, tiny_model_dir):
    _deploy(tiny_model_dir, engine_replica={"graceful_shutdown_timeout_s": 3})
    wait_for(lambda: _running_replicas() == 2, 60, 0.5, "2 replicas")

    async def main():
        async with httpx.AsyncClient(base_url=drain_app, timeout=180) as http:
            streams = [asyncio.create_task(_stream(http)) for _ in range(8)]
            await asyncio.sleep(4)
            await asyncio.to_thread(_deploy, tiny_model_dir, False,
                                    {"graceful_shutdown_timeout_s": 3, "num_replicas": 1})
            return await asyncio.gather(*streams)

    results = asyncio.run(main())
    cut = 0
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]", events[-2:]  # never a silent cut
        last = json.loads(events[-2])
        if "error" in last:
            cut += 1
            assert last["error"]["code"] == "service_unavailable", last
        else:
            assert last["usage"]["completion_tokens"] == MAX_TOKENS
    assert 0 < cut < len(results), "streams on the removed replica only"
