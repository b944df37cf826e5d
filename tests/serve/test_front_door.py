"""The ingress's own HTTP server (direct_http) over real Ray Serve: its request limit, and a drain
that lets open streams finish while new connections go elsewhere.

(Streams, coalescing, disconnects and a killed replica over this path: test_token_path.py;
the main app of every other serving test is served this way too.)
"""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from bench.common import free_port
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, deploy, wait_for

APP = "frontdoor"
PREFIX = "/frontdoor"


def stream_body(max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "prompt": "front door", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}


def refused(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def deploy_door(tiny_model_dir, graceful_shutdown_timeout_s: float):
    """A direct-HTTP app whose ingress takes one request at a time, on a slow engine."""
    from ray import serve

    port = free_port()
    deploy(dict(model=tiny_model_dir, num_replicas=1, replica_num_cpus=0.5, direct_http=True,
                port=port, ingress_max_ongoing_requests=1,
                graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
                engine_class="tests.serve.slow_engine:VerySlowEngine", **ENGINE_ARGS),
           APP, PREFIX)
    yield port
    if APP in serve.status().applications:
        serve.delete(APP)


@pytest.fixture()
def door(cluster, tiny_model_dir):
    yield from deploy_door(tiny_model_dir, 30)


@pytest.fixture()
def short_drain_door(cluster, tiny_model_dir):
    yield from deploy_door(tiny_model_dir, 6)


def test_past_its_limit_the_door_answers_503_and_stays_healthy(door):
    base = f"http://127.0.0.1:{door}"
    with httpx.Client(base_url=base, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=stream_body(30)) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream (a disconnect)
            next(lines)  # the held stream is running
            second = http.post("/v1/completions", json={**stream_body(2), "stream": False})
            assert second.status_code == 503
            assert second.headers["retry-after"] == "1"
            assert second.json()["error"]["code"] == "service_unavailable"
            assert http.get("/health").status_code == 200  # probes are not requests
        # Leaving the held stream is a disconnect, which the server learns of asynchronously.
        wait_for(lambda: http.post("/v1/completions", json={**stream_body(2), "stream": False}
                                   ).status_code == 200, 20, interval_s=0.5,
                 what="the slot given back after the held stream's disconnect")


def start_reading(port: int, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """A stream read in a thread, its events' data collected; returns once the first arrived."""
    received: list[str] = []
    first = threading.Event()

    def read_stream():
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            body = {**stream_body(max_tokens), "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        received.append(line[len("data: "):])
                        first.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert first.wait(60)
    return reader, received


def test_deleting_the_app_drains_open_streams_and_stops_accepting(door):
    from ray import serve

    reader, received = start_reading(door, 80)
    serve.delete(APP, _blocking=False)
    # 80 steps of 100 ms: the door closes well before the stream can have finished.
    wait_for(lambda: refused(door), 15, what="the ingress to stop accepting connections")
    assert reader.is_alive(), "the stream ended before the door closed: the test proves nothing"
    reader.join(60)
    assert received[-1] == "[DONE]"
    chunks = [json.loads(e) for e in received[:-1]]
    assert not [c for c in chunks if "error" in c], "the drain cut the stream"
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 80
    wait_for(lambda: APP not in serve.status().applications, 60, what="the app to be deleted")


def test_a_stream_longer_than_the_drain_ends_with_an_error_event_not_a_cut(short_drain_door):
    from ray import serve

    reader, received = start_reading(short_drain_door, 400)  # 40 s of tokens, 6 s of drain
    serve.delete(APP, _blocking=False)
    reader.join(30)
    assert not reader.is_alive()
    assert received[-1] == "[DONE]"
    last = json.loads(received[-2])
    assert last["error"]["code"] == "service_unavailable" and "shutting down" in \
        last["error"]["message"]
    wait_for(lambda: APP not in serve.status().applications, 60, what="the app to be deleted")
