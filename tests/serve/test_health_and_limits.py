"""A second app with one faulty-able replica and tiny queue limits: 429 + Retry-After when the
queue is full; a failed engine step fails only its requests (an error event then [DONE]) and the
engine serves on; failures in a row stop the engine, /health is 503 until Ray Serve has replaced
the replica, then 200 again."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

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
                engine_stall_timeout_s=3, readiness_window_s=3, graceful_shutdown_timeout_s=2,
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


def _stream_events(http: httpx.Client, max_tokens: int = 100) -> list[str]:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200  # the stream had started: the failure is in-band
    return [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]


def _failed_stream_error(events: list[str]) -> dict:
    assert events[-1] == "[DONE]"
    assert any("choices" in json.loads(e) for e in events[:-2]), "tokens came before the failure"
    return json.loads(events[-2])["error"]


def test_a_failed_step_fails_only_its_requests(limited, fault_file):
    with httpx.Client(base_url=limited, timeout=60, headers=AUTH) as http:
        (before,) = replica_stats(APP, 1)
        fault_file.write_text("once")
        error = _failed_stream_error(_stream_events(http))
        assert error["code"] == "engine_step_failed" and error["type"] == "server_error", error
        assert "injected step fault" in error["message"]
        ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello",
                                                "max_tokens": 5, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert http.get("/health").status_code == 200
        ((after, stats),) = replica_stats(APP, 1).items()
        assert after == before, "the replica was not replaced"
        assert stats["healthy"] and stats["num_requests"] == 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "the failed request's blocks"


def test_engine_death_mid_stream_then_health_503_then_recovery(limited, fault_file):
    with httpx.Client(base_url=limited, timeout=60, headers=AUTH) as http:
        assert http.get("/health").status_code == 200
        (before,) = replica_stats(APP, 1)
        fault_file.write_text("die")
        error = _failed_stream_error(_stream_events(http))
        assert error["code"] == "engine_step_failed", error
        # The next step fails too: two in a row, and the engine loop stops.
        dead = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello",
                                                  "max_tokens": 3})
        assert dead.status_code == 503, dead.text
        assert dead.json()["error"]["code"] == "service_unavailable"
        assert "engine" in dead.json()["error"]["message"]

        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        assert "Retry-After" in health.headers

        wait_for(lambda: http.get("/health").status_code == 200, 90, 0.5, "/health back to 200")
        (after,) = replica_stats(APP, 1)
        assert after != before, "Ray Serve replaced the replica whose engine died"
        ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200


def test_ready_means_a_token_came_out_lately(limited):
    with httpx.Client(base_url=limited, timeout=60) as http:  # open like /health: no key
        ready = wait_for(lambda: (r := http.get("/health/ready")).status_code == 200 and r, 30, 0.5,
                         "/health/ready 200")
        assert "generated within the last 3 s" in ready.json()["detail"]
        time.sleep(5)  # idle, longer than the window: the replica's probe keeps it ready
        assert http.get("/health/ready").status_code == 200


def test_a_stalled_engine_is_not_ready_and_is_replaced(limited, fault_file):
    with httpx.Client(base_url=limited, timeout=90, headers=AUTH) as http:
        wait_for(lambda: http.get("/health/ready").status_code == 200, 30, 0.5, "ready")
        ((before, _),) = replica_stats(APP, 1).items()
        fault_file.write_text("stall")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(http.post, "/v1/completions",
                                json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 50,
                                      "ignore_eos": True})
            not_ready = wait_for(lambda: (r := http.get("/health/ready")).status_code == 503 and r,
                                 20, 0.25, "/health/ready 503 while the engine is stalled")
            assert not_ready.json()["error"]["code"] == "service_unavailable"
            assert "Retry-After" in not_ready.headers
            wait_for(lambda: http.get("/health/ready").status_code == 200, 90, 0.5,
                     "/health/ready 200 once Ray Serve replaced the stalled replica")
            response = stuck.result(timeout=90)
        # It had no output when its core went: sent again to the replacement where that was up
        # by then, else an OpenAI-shaped error, never a cut.
        assert response.status_code in (200, 500, 503), response.text
        assert ("choices" if response.status_code == 200 else "error") in response.json()
        ((after, _),) = replica_stats(APP, 1).items()
        assert after != before
