"""Anthropic's SDK against the running app, unchanged: messages, streams, forced tool use, token
counts, keys (`x-api-key` or Bearer) and errors in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.serve.conftest import API_KEY, MODEL_NAME

MESSAGES = [{"role": "user", "content": "what is the capital of france"}]
GREEDY = {"temperature": 0}  # not an argument of the SDK's create(): sent as an extra field
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["tz"],
         "properties": {"tz": {"enum": ["UTC"]}}}
TOOLS = [{"name": "weather", "description": "today's weather", "input_schema": CITY},
         {"name": "now", "input_schema": CLOCK}]


@pytest.fixture(scope="module")
def claude(app):
    return anthropic.Anthropic(base_url=app.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_stream_and_stop_sequences(claude, http):
    whole = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=MESSAGES,
                                   extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == MODEL_NAME and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 12
    num_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == num_prompt
    assert claude.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES).input_tokens == \
        num_prompt

    with claude.messages.stream(model=MODEL_NAME, max_tokens=12, messages=MESSAGES,
                                extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(whole) and len(streamed) > 4
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12

    stop = text_of(whole)[3:5]
    stopped = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=MESSAGES,
                                     stop_sequences=[stop], extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert text_of(stopped) == text_of(whole)[:text_of(whole).index(stop)]


def test_a_finished_json_answer_ends_the_turn(claude):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    message = claude.messages.create(
        model=MODEL_NAME, max_tokens=32, messages=MESSAGES, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    jsonschema.validate(json.loads(text_of(message)), schema)


@pytest.mark.parametrize("tool_choice", [
    {"type": "tool", "name": "weather"},
    {"type": "any", "disable_parallel_tool_use": True},
])
def test_forced_tool_use_gives_input_matching_its_schema(claude, tool_choice):
    args = dict(model=MODEL_NAME, max_tokens=64, messages=MESSAGES, tools=TOOLS,
                tool_choice=tool_choice, extra_body=GREEDY)
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        final = stream.get_final_message()
    for message in (whole, final):
        assert message.stop_reason == "tool_use"
        calls = [block for block in message.content if block.type == "tool_use"]
        assert len(calls) == 1 and calls[0].id.startswith("toolu_")
        schema = {tool["name"]: tool["input_schema"] for tool in TOOLS}[calls[0].name]
        jsonschema.validate(calls[0].input, schema)
        if tool_choice["type"] == "tool":
            assert calls[0].name == "weather"
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]

    # The client's next turn: the SDK's own blocks back, and the tool's result.
    call = whole.content[-1]
    answer = claude.messages.create(model=MODEL_NAME, max_tokens=3, tools=TOOLS, messages=[
        *MESSAGES, {"role": "assistant", "content": whole.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "sunny"}]}])
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_keys_as_x_api_key_and_wrong_keys_refused(app, claude):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": MESSAGES}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    accepted = httpx.post(f"{app.base_url}/v1/messages", json=body, headers=headers, timeout=60)
    assert accepted.status_code == 200 and accepted.json()["type"] == "message"
    wrong = anthropic.Anthropic(base_url=app.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(**body)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_errors_are_anthropic_shaped(app, claude):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=MESSAGES)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in caught.value.body["error"]["message"]

    missing = httpx.post(f"{app.base_url}/v1/messages", headers={"x-api-key": API_KEY},
                         json={"model": MODEL_NAME, "messages": MESSAGES}, timeout=60)
    assert missing.status_code == 400
    assert missing.json()["type"] == "error"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]

    # A stream that cannot start (the context is 512 tokens) is a plain error, not an event.
    with pytest.raises(anthropic.BadRequestError) as caught:
        with claude.messages.stream(model=MODEL_NAME, max_tokens=600, messages=MESSAGES) as stream:
            stream.get_final_message()
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "512" in caught.value.body["error"]["message"]


def test_ray_handle_callers_get_messages_and_events(app):
    from ray import serve

    handle = serve.get_app_handle(app.name)
    request = {"model": MODEL_NAME, "max_tokens": 6, "messages": MESSAGES, **GREEDY}
    whole = handle.messages.remote(request).result()
    events = list(handle.options(stream=True).messages.remote({**request, "stream": True}))
    assert [e.type for e in events[:2]] == ["message_start", "ping"]
    assert [e.type for e in events[-2:]] == ["message_delta", "message_stop"]
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == text_of(whole) and whole.stop_reason == events[-2].delta.stop_reason
