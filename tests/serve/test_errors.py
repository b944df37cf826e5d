"""Every error is OpenAI-shaped with the right status: 400 (never 422), 401, 404."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import API_KEY, MODEL_NAME

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}


def assert_error(response: httpx.Response, status: int, param: str | None = "any", code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "any":
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, None),
    ("/v1/chat/completions", {**CHAT, "unknown_field": 1}, "unknown_field"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, None),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999": 1}}, None),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": -3}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 999999]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, None),
    ("/v1/completions", {**COMPLETION, "min_tokens": 9}, "min_tokens"),
    ("/v1/completions", {k: v for k, v in COMPLETION.items() if k != "prompt"}, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
])
def test_invalid_bodies_are_400(http, path, body, param):
    error = assert_error(http.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)


def test_malformed_json_is_400(http):
    response = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                         headers={"content-type": "application/json"})
    assert_error(response, 400, code="invalid_json")
    assert_error(http.post("/v1/completions", content=b"[1, 2]",
                           headers={"content-type": "application/json"}), 400)


def test_context_length_is_400_with_the_numbers(http):
    error = assert_error(http.post("/v1/completions", json={**COMPLETION, "max_tokens": 600}), 400,
                         code="context_length_exceeded")
    assert "512" in error["message"] and "600" in error["message"]
    long_prompt = " ".join(["paged attention"] * 400)
    error = assert_error(http.post("/v1/chat/completions", json={
        **CHAT, "messages": [{"role": "user", "content": long_prompt}], "max_tokens": None}), 400,
        code="context_length_exceeded")
    assert "512" in error["message"]


def test_unknown_model_and_route_are_404(http):
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17"}), 404,
                 param="model", code="model_not_found")
    assert_error(http.get("/v1/models/gpt-17"), 404, code="model_not_found")
    # A generating model without pooling serves no embeddings: a 400 that says so.
    assert_error(http.post("/v1/embeddings", json={"input": "x"}), 400, code="model_not_supported")
    assert_error(http.get("/nowhere"), 404)
    assert http.get(f"/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME


def test_api_keys(app, http):
    with httpx.Client(base_url=app.base_url, timeout=30) as anonymous:
        assert_error(anonymous.post("/v1/chat/completions", json=CHAT), 401, code="invalid_api_key")
        assert_error(anonymous.get("/v1/models"), 401)
        wrong = {"Authorization": "Bearer sk-wrong"}
        assert_error(anonymous.post("/v1/chat/completions", json=CHAT, headers=wrong), 401)
        assert_error(anonymous.post("/v1/chat/completions", json=CHAT,
                                    headers={"Authorization": API_KEY}), 401)  # no "Bearer"
        # Checked before the body: a bad key with a bad body is still 401.
        assert_error(anonymous.post("/v1/completions", content=b"{", headers=wrong), 401)
        assert anonymous.get("/health").status_code == 200  # open for load balancers
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_openai_sdk_sees_typed_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=4,
                                       temperature=5)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT["messages"])
    bad_key = openai.OpenAI(base_url=str(client.base_url), api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
