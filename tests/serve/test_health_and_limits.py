"""A second app with one faulty-able replica and tiny queue limits: 429 + Retry-After when the
queue is full, an error event then [DONE] when the engine dies mid-stream, /health 503 while the
engine loop is dead and 200 again once Ray Serve has replaced the replica."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, deploy, replica_stats, wait_for

APP = "limited"
PREFIX = "/limited"
KEY = "sk-limited"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def limited(cluster, tiny_model_dir):
    deploy(dict(model=tiny_model_dir, num_replicas=1, replica_num_cpus=0.5,
                replica_max_ongoing_requests=1, max_queued_requests=1, retry_after_s=2,
                api_keys=KEY,
                health_check_period_s=0.5, engine_class="tests.serve.faulty_engine:FaultyEngine",
                **ENGINE_ARGS), APP, PREFIX)
    yield f"{cluster.base_url}{PREFIX}"
    from ray import serve
    serve.delete(APP)


def test_keys_under_a_route_prefix(limited):
    assert httpx.get(f"{limited}/health").status_code == 200  # open
    assert httpx.get(f"{limited}/v1/models").status_code == 401
    assert httpx.get(f"{limited}/v1/models", headers=AUTH).status_code == 200


def test_full_queue_is_429_with_retry_after(limited):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 200, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(base_url=limited, timeout=60, headers=AUTH) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 2 and 429 in statuses, [(r.status_code, r.text[:300])
                                                           for r in responses]
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["Retry-After"] == "2"
    assert rejected.json()["error"]["code"] == "engine_overloaded"
    assert set(statuses) <= {200, 429}


def test_engine_death_mid_stream_then_health_503_then_recovery(limited, fault_file):
    with httpx.Client(base_url=limited, timeout=60, headers=AUTH) as http:
        assert http.get("/health").status_code == 200
        (before,) = replica_stats(APP, 1)
        fault_file.write_text("die")
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 100, "ignore_eos": True,
                "stream": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200  # the stream had started: the failure is in-band
        events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "engine" in error["message"]
        assert any("choices" in json.loads(e) for e in events[:-2]), "tokens came before the failure"

        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        assert "Retry-After" in health.headers

        wait_for(lambda: http.get("/health").status_code == 200, 90, 0.5, "/health back to 200")
        (after,) = replica_stats(APP, 1)
        assert after != before, "Ray Serve replaced the replica whose engine died"
        ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200
