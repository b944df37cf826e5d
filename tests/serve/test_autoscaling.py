"""Queue-depth autoscaling on real Ray Serve: sustained queued load scales 1 -> 2 within the
configured delay, idle scales back to 1, and no request fails while a replica drains; with
min_replicas=0, idle goes to zero and the next request brings a replica back."""
from __future__ import annotations

import asyncio
import itertools
import time

import httpx

from tests.serve.conftest import deploy

APP = "autoscale"
PREFIX = "/autoscale"
UPSCALE_DELAY_S = 2.0
DOWNSCALE_DELAY_S = 4.0
LOOK_BACK_S = 5.0  # pagedserve.serve_app.autoscaling.DEFAULTS["look_back_period_s"]
DECISION_SLACK_S = 10.0  # metric pushes (1 s), the controller loop, a busy machine
START_LIMIT_S = 90.0  # a new replica process imports torch and loads the model on 2 busy cores
_CALLS = itertools.count()  # load_until's calls, to keep every prompt unique


def replica_states() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or "EngineReplica" not in app.deployments:
        return {}
    return dict(app.deployments["EngineReplica"].replica_states)


def num_wanted() -> int:
    """Replicas the autoscaler has asked for: starting or running."""
    return sum(n for state, n in replica_states().items() if state != "STOPPING")


def num_running() -> int:
    return replica_states().get("RUNNING", 0)


async def load_until(base_url: str, concurrency: int, done, results: list, limit_s: float) -> float:
    """`concurrency` clients send requests back to back until done() holds (checked off the event
    loop every 0.25 s) or limit_s passes; returns the seconds it took."""
    began = time.monotonic()
    stop = asyncio.Event()
    call = next(_CALLS)

    async def watch():
        while time.monotonic() - began < limit_s and not await asyncio.to_thread(done):
            await asyncio.sleep(0.25)
        stop.set()

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def worker(i: int):
            n = 0
            while not stop.is_set():
                # Unique from the first token, across calls too: a prompt sent again is prefix
                # reuse, whose working set holds replicas up for a minute by design (tested in
                # tests/unit/test_autoscaling.py); this test is about queue and load.
                body = {"model": "tiny", "prompt": f"{call}.{i}.{n} the quick brown fox",
                        "max_tokens": 64, "ignore_eos": True, "temperature": 0}
                try:
                    response = await client.post("/v1/completions", json=body)
                    ok = (response.status_code == 200
                          and response.json()["usage"]["completion_tokens"] == 64)
                    results.append(True if ok else response.text)
                except Exception as exc:  # noqa: BLE001 - any failure is the finding
                    results.append(repr(exc))
                n += 1

        await asyncio.gather(watch(), *(worker(i) for i in range(concurrency)))
    return time.monotonic() - began


def failures(results: list) -> list:
    return [r for r in results if r is not True][:3]


def test_queue_depth_scales_up_under_load_and_back_down_without_failures(cluster, tiny_model_dir):
    from ray import serve

    deploy(dict(model=tiny_model_dir, served_model_name="tiny", replica_num_cpus=0.5,
                min_replicas=1, max_replicas=2, target_queue_depth=2,
                upscale_delay_s=UPSCALE_DELAY_S, downscale_delay_s=DOWNSCALE_DELAY_S,
                graceful_shutdown_timeout_s=60, max_model_len=256, num_kv_blocks=128,
                max_num_seqs=2, block_size=16), APP, PREFIX)
    base_url = f"{cluster.base_url}{PREFIX}"
    try:
        assert num_running() == 1
        # 8 clients against one replica that runs 2 at a time: ~6 requests queue all along.
        results: list = []
        limit = UPSCALE_DELAY_S + LOOK_BACK_S + DECISION_SLACK_S
        decided_s = asyncio.run(load_until(base_url, 8, lambda: num_wanted() >= 2, results, limit))
        assert num_wanted() == 2, f"no scale-up decision within {limit:.0f}s"
        asyncio.run(load_until(base_url, 8, lambda: num_running() >= 2, results, START_LIMIT_S))
        assert num_running() == 2, f"the second replica did not start within {START_LIMIT_S:.0f}s"
        assert results and not failures(results), failures(results)

        # Light traffic (nothing queues, one replica's batch half full): back to 1 after the
        # downscale delay, with requests running all along: the one removed drains its own.
        # (Two streams would fill one replica's batch of 2: the policy then keeps both.)
        results = []
        limit = DOWNSCALE_DELAY_S + LOOK_BACK_S + DECISION_SLACK_S
        down_s = asyncio.run(load_until(base_url, 1, lambda: num_wanted() <= 1, results, limit))
        assert num_wanted() == 1, f"no scale-down within {limit:.0f}s"
        assert results and not failures(results), failures(results)
        print(f"scale-up decided after {decided_s:.1f}s, scale-down after {down_s:.1f}s")
    finally:
        serve.delete(APP)


def test_a_deployment_scaled_to_zero_starts_a_replica_for_the_next_request(cluster,
                                                                           tiny_model_dir):
    """min_replicas=0: idle, the deployment goes to zero replicas; the next request waits in the
    ingress, which asks Ray Serve for a replica, and is served once one has started."""
    from ray import serve

    deploy(dict(model=tiny_model_dir, served_model_name="tiny", replica_num_cpus=0.5,
                min_replicas=0, max_replicas=1, upscale_delay_s=0, downscale_delay_s=1,
                max_model_len=256, num_kv_blocks=64, block_size=16), APP, PREFIX)
    base_url = f"{cluster.base_url}{PREFIX}"
    try:
        limit = time.monotonic() + 1 + LOOK_BACK_S + DECISION_SLACK_S + 20
        while sum(replica_states().values()) and time.monotonic() < limit:  # stopped, not stopping
            time.sleep(0.5)
        assert not sum(replica_states().values()), f"still {replica_states()} replicas when idle"
        body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8,
                "ignore_eos": True, "temperature": 0}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=START_LIMIT_S + 60)
        assert response.status_code == 200, response.text  # a replica started and served it
        assert response.json()["usage"]["completion_tokens"] == 8
    finally:
        serve.delete(APP)
