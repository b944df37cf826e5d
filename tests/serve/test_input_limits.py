"""Every bounded request field at its limit (served) and one past it (a 400 naming the field), the
body-size limit as a 413 with and without a Content-Length, request_timeout_s ending a request that
runs too long (a 408, or an error event in a stream, and no KV block left behind), and the server
serving normally after all of it. An app of its own with small limits keeps each case cheap; the
main app shows the defaults refusing what used to be accepted."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, deploy, replica_stats, wait_for

APP = "bounded"
PREFIX = "/bounded"
LIMITS = dict(max_n=3, max_stop_strings=3, max_stop_string_chars=8, max_stop_token_ids=4,
              max_logit_bias_entries=4, max_messages=4, max_prompt_chars=200,
              max_prompts_per_request=3, max_request_body_bytes=4096)
TIMEOUT_S = 1.5  # a step takes >= 5 ms here (SlowEngine): 480 tokens take >= 2.4 s


@pytest.fixture(scope="module")
def bounded(cluster, tiny_model_dir):
    deploy(dict(model=tiny_model_dir, num_replicas=1, replica_num_cpus=0.5, **LIMITS,
                request_timeout_s=TIMEOUT_S, engine_class="tests.serve.slow_engine:SlowEngine",
                **ENGINE_ARGS), APP, PREFIX)
    with httpx.Client(base_url=f"{cluster.base_url}{PREFIX}", timeout=60) as http:
        yield http
    from ray import serve
    serve.delete(APP)


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **fields}


CASES = [  # (route, body at the limit, body one past it, the field named)
    ("completions", _completion(n=3), _completion(n=4), "n"),
    ("completions", _completion(stop=["a", "b", "c"]), _completion(stop=["a", "b", "c", "d"]), "stop"),
    ("completions", _completion(stop="x" * 8), _completion(stop="x" * 9), "stop"),
    ("chat", _chat(stop=["12345678"]), _chat(stop=["123456789"]), "stop"),
    ("completions", _completion(stop_token_ids=[1, 2, 3, 4]), _completion(stop_token_ids=[1, 2, 3, 4, 5]),
     "stop_token_ids"),
    ("completions", _completion(logit_bias={str(i): 1.0 for i in range(4)}),
     _completion(logit_bias={str(i): 1.0 for i in range(5)}), "logit_bias"),
    ("completions", _completion(prompt=["a", "b", "c"]), _completion(prompt=["a", "b", "c", "d"]), "prompt"),
    ("completions", _completion(prompt="y" * 200), _completion(prompt="y" * 201), "prompt"),
    ("chat", _chat(messages=[{"role": "user", "content": "hi"}] * 4),
     _chat(messages=[{"role": "user", "content": "hi"}] * 5), "messages"),
    ("chat", _chat(messages=[{"role": "user", "content": "z" * 100}] * 2),
     _chat(messages=[{"role": "user", "content": "z" * 100}, {"role": "user", "content": "z" * 101}]),
     "messages"),
    ("completions", _completion(logprobs=20), _completion(logprobs=21), "logprobs"),
    ("chat", _chat(logprobs=True, top_logprobs=20), _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
]
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.mark.parametrize("route,at_limit,past_limit,param", CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_limit_boundary(bounded, route, at_limit, past_limit, param):
    accepted = bounded.post(ROUTES[route], json=at_limit)
    assert accepted.status_code == 200, accepted.text
    rejected = bounded.post(ROUTES[route], json=past_limit)
    assert rejected.status_code == 400, rejected.text
    error = rejected.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def _padded(body: dict, size: int) -> bytes:
    """The body as JSON padded with whitespace (still valid JSON) to exactly `size` bytes."""
    raw = json.dumps(body).encode()
    return raw + b" " * (size - len(raw))


def test_body_size_boundary_and_413(bounded):
    limit = LIMITS["max_request_body_bytes"]
    headers = {"Content-Type": "application/json"}
    at_limit = bounded.post("/v1/completions", content=_padded(_completion(), limit), headers=headers)
    assert at_limit.status_code == 200, at_limit.text
    declared = bounded.post("/v1/completions", content=_padded(_completion(), limit + 1), headers=headers)
    assert declared.status_code == 413, declared.text
    assert declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is found while reading
        yield _padded(_completion(), 1024)
        for _ in range(64):
            yield b" " * 1024

    streamed = bounded.post("/v1/completions", content=chunks(), headers=headers)
    assert streamed.status_code == 413, streamed.text


def test_request_timeout_ends_long_requests_and_frees_their_blocks(bounded):
    long = _completion(prompt="hello", max_tokens=480, ignore_eos=True)
    timed_out = bounded.post("/v1/completions", json=long)
    assert timed_out.status_code == 408, timed_out.text
    assert timed_out.json()["error"]["code"] == "request_timeout"
    streamed = bounded.post("/v1/completions", json={**long, "stream": True})
    assert streamed.status_code == 200
    events = [line[6:] for line in streamed.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert any("choices" in json.loads(e) for e in events[:-2])

    def idle():
        (stats,) = replica_stats(APP, 1).values()
        return stats["num_requests"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    wait_for(idle, 10, 0.2, "the timed-out requests aborted and their blocks freed")


def test_serving_normally_afterwards(bounded):
    for _ in range(3):
        response = bounded.post("/v1/completions", json=_completion(max_tokens=8, ignore_eos=True))
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 8


def test_default_limits_refuse_a_thousand_stop_strings(http):
    response = http.post("/v1/completions", json=_completion(stop=["s" * 100] * 1000))
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"


def test_priority_needs_the_priority_policy(http):
    response = http.post("/v1/completions", json=_completion(priority=1))
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    assert http.post("/v1/completions", json=_completion(priority=0)).status_code == 200
