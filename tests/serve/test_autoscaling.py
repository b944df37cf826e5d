"""Queue-depth autoscaling on real Ray Serve: sustained queued load scales 1 -> 2 within the
configured delay, idle scales back to 1, and no request fails while a replica drains."""
from __future__ import annotations

import asyncio
import time

import httpx

from tests.serve.conftest import deploy

APP = "autoscale"
PREFIX = "/autoscale"
UPSCALE_DELAY_S = 2.0
DOWNSCALE_DELAY_S = 4.0
LOOK_BACK_S = 5.0  # serve_app.autoscaling.DEFAULTS["look_back_period_s"]
# Replica start-up (model load) and Ray's control loop, on 2 busy cores.
START_SLACK_S = 25.0


def num_running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or "EngineReplica" not in app.deployments:
        return 0
    return app.deployments["EngineReplica"].replica_states.get("RUNNING", 0)


async def load_until(base_url: str, concurrency: int, done, max_tokens: int, results: list,
                     deadline_s: float) -> None:
    """`concurrency` clients each send requests back to back until done() or the deadline."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def worker(i: int):
            n = 0
            while not done() and time.monotonic() < deadline_s:
                body = {"model": "tiny", "prompt": f"client {i} request {n} the quick brown fox",
                        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
                try:
                    response = await client.post("/v1/completions", json=body)
                    ok = response.status_code == 200 and \
                        response.json()["usage"]["completion_tokens"] == max_tokens
                    results.append(ok or response.text)
                except Exception as exc:  # noqa: BLE001 - any failure is the finding
                    results.append(repr(exc))
                n += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def test_queue_depth_scales_up_under_load_and_back_down_without_failures(cluster, tiny_model_dir):
    from ray import serve

    deploy(dict(model=tiny_model_dir, served_model_name="tiny", replica_num_cpus=0.5,
                min_replicas=1, max_replicas=2, target_queue_depth=2,
                upscale_delay_s=UPSCALE_DELAY_S, downscale_delay_s=DOWNSCALE_DELAY_S,
                graceful_shutdown_timeout_s=60,
                max_model_len=256, num_kv_blocks=128, max_num_seqs=2, block_size=16), APP, PREFIX)
    base_url = f"{cluster.base_url}{PREFIX}"
    try:
        assert num_running_replicas() == 1
        # 8 clients against max_num_seqs=2: ~6 requests queue at all times.
        results: list = []
        began = time.monotonic()
        limit = UPSCALE_DELAY_S + LOOK_BACK_S + START_SLACK_S
        asyncio.run(load_until(base_url, 8, lambda: num_running_replicas() >= 2, 64, results,
                               deadline_s=began + limit))
        scale_up_s = time.monotonic() - began
        assert num_running_replicas() == 2, f"no scale-up within {limit:.0f}s"
        assert all(r is True for r in results), [r for r in results if r is not True][:3]

        # Light traffic (nothing queues): back to 1 after the downscale delay, while requests keep
        # running on both replicas: the one removed drains them.
        results = []
        began = time.monotonic()
        limit = DOWNSCALE_DELAY_S + LOOK_BACK_S + START_SLACK_S
        asyncio.run(load_until(base_url, 2, lambda: num_running_replicas() <= 1, 64, results,
                               deadline_s=began + limit))
        scale_down_s = time.monotonic() - began
        assert num_running_replicas() == 1, f"no scale-down within {limit:.0f}s"
        assert results and all(r is True for r in results), [r for r in results if r is not True][:3]
        print(f"scale-up after {scale_up_s:.1f}s, scale-down after {scale_down_s:.1f}s")
    finally:
        serve.delete(APP)
