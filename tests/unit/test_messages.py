"""Anthropic's Messages door without Ray: the request as a chat request, chat answers and chunks
as messages and events (the `anthropic` client's own accumulator rebuilds the whole answer from
the events), errors in Anthropic's shape, and keys as `x-api-key`."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message
from fastapi import FastAPI
from starlette.testclient import TestClient

from pagedserve.replicas.core.outputs import CompletionOutput, RequestOutput
from pagedserve.serve_app import errors
from pagedserve.serve_app import messages as anthropic_messages
from pagedserve.serve_app.formatters import ChatFormatter
from pagedserve.serve_app.http import FrontDoorMiddleware
from pagedserve.serve_app.protocol import ChatCompletionResponse, Usage
from pagedserve.serve_app.protocol.messages import MessagesRequest

WEATHER = {"name": "weather", "description": "today's weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CLOCK = {"name": "now", "input_schema": {"type": "object"}}
HI = [{"role": "user", "content": "hi"}]


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": HI, **fields})


def chat_dict(**fields) -> dict:
    return anthropic_messages.chat_request(request(**fields)).model_dump(exclude_defaults=True)


# -- request ---------------------------------------------------------------------------------------
def test_a_tool_conversation_becomes_chat_messages():
    chat = chat_dict(
        system=[{"type": "text", "text": "be brief"}], tools=[WEATHER], stop_sequences=["###"],
        temperature=0.5, top_p=0.9, top_k=4, metadata={"user_id": "u1"}, messages=[
            {"role": "user", "content": "weather in paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "a tool knows", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather",
                 "input": {"city": "paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "and tomorrow?"}]}])
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather in paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "today's weather",
        "parameters": WEATHER["input_schema"]}}]
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["top_p"], chat["top_k"],
            chat["user"]) == (8, ["###"], 0.5, 0.9, 4, "u1")
    assert "stream" not in chat and "continue_final_message" not in chat


@pytest.mark.parametrize("tool_choice,expected", [
    ({"type": "auto"}, "auto"),
    ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "now"}, {"type": "function", "function": {"name": "now"}}),
])
def test_tool_choice_maps_to_openai(tool_choice, expected):
    chat = chat_dict(tools=[WEATHER, CLOCK], tool_choice=tool_choice)
    assert chat["tool_choice"] == expected and "parallel_tool_calls" not in chat
    serial = chat_dict(tools=[WEATHER],
                       tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert serial["parallel_tool_calls"] is False
    # Without tools there is nothing to choose.
    assert "tool_choice" not in chat_dict(tool_choice={"type": "auto"})


def test_a_final_assistant_message_is_continued_and_streams_carry_usage():
    chat = chat_dict(messages=[*HI, {"role": "assistant", "content": "The answer is"}], stream=True)
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_output_config_format_is_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_dict(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema}}


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": [{"type": "text", "text": "look"},
                                   {"type": "image", "source": {"type": "url", "url": "x"}}]}],
     "messages.0.content.1.type"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}]}], "messages.0.content.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}],
     "messages.0.content.0"),
])
def test_unsupported_blocks_are_400_naming_the_block(messages, param):
    with pytest.raises(errors.OpenAIError) as caught:
        anthropic_messages.chat_request(request(messages=messages))
    assert caught.value.status_code == 400 and caught.value.param == param
    body = errors.anthropic_error_body(caught.value)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert param in body["error"]["message"]


def test_chat_errors_name_the_messages_field():
    chat_error = errors.bad_request("stop has 20 strings; at most 16 are allowed", "stop")
    error = errors.renamed(chat_error, anthropic_messages.RENAMED_PARAMS)
    assert error.param == "stop_sequences"
    assert error.message == "stop_sequences has 20 strings; at most 16 are allowed"
    with pytest.raises(errors.OpenAIError) as caught:
        anthropic_messages.chat_request(request(stop_sequences=[""]))
    assert caught.value.param == "stop_sequences"


# -- whole answers ---------------------------------------------------------------------------------
def chat_response(message: dict, finish_reason: str, stop_reason=None) -> ChatCompletionResponse:
    return ChatCompletionResponse.model_validate({
        "id": "chatcmpl-abc", "model": "m", "choices": [{
            "index": 0, "message": message, "finish_reason": finish_reason,
            "stop_reason": stop_reason}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
                  "prompt_tokens_details": {"cached_tokens": 32}}})


@pytest.mark.parametrize("finish_reason,stop_reason,expected", [
    ("stop", None, ("end_turn", None)),
    ("stop", 2, ("end_turn", None)),  # a stop token id ends the turn
    ("stop", "###", ("stop_sequence", "###")),
    ("length", None, ("max_tokens", None)),
])
def test_a_text_answer_is_a_message(finish_reason, stop_reason, expected):
    message = anthropic_messages.message_response(
        chat_response({"content": "Paris."}, finish_reason, stop_reason))
    dumped = message.model_dump()
    assert dumped == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                      "content": [{"type": "text", "text": "Paris."}],
                      "stop_reason": expected[0], "stop_sequence": expected[1],
                      "usage": {"input_tokens": 8, "output_tokens": 5,
                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32}}
    Message.model_validate(dumped)  # the anthropic client's own type reads it


def test_tool_calls_are_tool_use_blocks_with_objects():
    message = anthropic_messages.message_response(chat_response({"content": "Ok.", "tool_calls": [
        {"id": "call-7f", "function": {"name": "weather", "arguments": '{"city": "rome"}'}},
        {"id": "call-80", "function": {"name": "now", "arguments": '{"tz": '}}]}, "tool_calls"))
    assert message.stop_reason == "tool_use"
    assert [b.model_dump() for b in message.content] == [
        {"type": "text", "text": "Ok."},
        {"type": "tool_use", "id": "toolu_7f", "name": "weather", "input": {"city": "rome"}},
        {"type": "tool_use", "id": "toolu_80", "name": "now", "input": {}}]  # cut off: no object


def test_reasoning_is_a_thinking_block_first():
    response = chat_response({"content": "42"}, "stop")
    message = SimpleNamespace(**{**response.choices[0].message.model_dump(),
                                 "reasoning_content": "six times seven"})
    response.choices[0] = SimpleNamespace(**{**vars(response.choices[0]), "message": message})
    blocks = anthropic_messages.message_response(response).content
    assert [b.model_dump() for b in blocks] == [
        {"type": "thinking", "thinking": "six times seven", "signature": ""},
        {"type": "text", "text": "42"}]


# -- streams ---------------------------------------------------------------------------------------
class Info:
    name, tokenizer, reasoning_parser = "m", None, None


async def outputs(text: str, size: int, finish_reason: str, stop_reason=None):
    pieces = [text[k:k + size] for k in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        yield 0, RequestOutput("r", None, [], [CompletionOutput(
            0, piece, [k], finish_reason=finish_reason if last else None,
            stop_reason=stop_reason if last else None)], finished=last, num_prompt_tokens=12,
            num_cached_tokens=4)


def answer(messages_request: MessagesRequest, text: str, size: int, finish_reason="stop",
           stop_reason=None):
    """(the whole message, the stream's events) for the model writing `text`."""
    chat = anthropic_messages.chat_request(messages_request)
    whole = ChatFormatter(chat.model_copy(update={"stream": False, "stream_options": None}), Info,
                          "chatcmpl-1", tools=chat.tool_spec())
    message = anthropic_messages.message_response(asyncio.run(
        whole.collect(outputs(text, size, finish_reason, stop_reason))))
    streamed = ChatFormatter(chat, Info, "chatcmpl-1", tools=chat.tool_spec())

    async def events():
        chunks = streamed.stream(outputs(text, size, finish_reason, stop_reason))
        return [e async for e in anthropic_messages.message_events(chunks)]
    return message, asyncio.run(events())


def rebuilt(events) -> Message:
    """What the anthropic client's stream helper accumulates from the events."""
    snapshot, buffers = None, {}
    for event in events:
        if event.type != "ping":
            snapshot = accumulate_event(event=json.loads(event.model_dump_json()),
                                        current_snapshot=snapshot, json_bufs=buffers)
    return snapshot


def blocks(message) -> list[tuple]:
    return [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
            for b in message.content]


def test_a_text_stream_is_anthropics_event_sequence():
    message, events = answer(request(stream=True, stop_sequences=["."]), "Paris is far", 3,
                             "stop", ".")
    assert [e.type for e in events] == [
        "message_start", "ping", "content_block_start", *["content_block_delta"] * 4,
        "content_block_stop", "message_delta", "message_stop"]
    start = events[0].message
    assert start.id == message.id == "msg_1" and start.content == []
    assert (start.usage.input_tokens, start.usage.cache_read_input_tokens) == (8, 4)
    assert events[2].content_block.model_dump() == {"type": "text", "text": ""}
    assert events[-2].model_dump() == {"type": "message_delta", "usage": {"output_tokens": 4},
                                       "delta": {"stop_reason": "stop_sequence",
                                                 "stop_sequence": "."}}
    final = rebuilt(events)
    assert final.content[0].text == message.content[0].text == "Paris is far"
    assert (final.stop_reason, final.stop_sequence) == (message.stop_reason, ".")


@pytest.mark.parametrize("tool_choice,text,names", [
    ({"type": "tool", "name": "weather"}, '{"city": "Lima"}', ["weather"]),
    ({"type": "any"}, '[{"name": "weather", "arguments": {"city": "Oslo"}}, '
                      '{"name": "now", "arguments": {}}]', ["weather", "now"]),
    ({"type": "auto"}, 'Checking. <tool_call>{"name": "now", "arguments": {"tz": "CET"}}'
                       '</tool_call>', ["now"]),
])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_tool_use_rebuilds_the_whole_message(tool_choice, text, names, size):
    message, events = answer(request(stream=True, tools=[WEATHER, CLOCK], tool_choice=tool_choice),
                             text, size)
    assert message.stop_reason == "tool_use"
    assert [b.name for b in message.content if b.type == "tool_use"] == names
    final = rebuilt(events)
    assert blocks(final) == blocks(message)  # ids differ: each answer draws its own
    assert final.stop_reason == "tool_use"
    assert all(b.id.startswith("toolu_") for b in final.content if b.type == "tool_use")
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.index for e in starts] == list(range(len(message.content)))
    assert all(s.content_block.input == {} for s in starts if s.content_block.type == "tool_use")


def test_streamed_reasoning_is_a_thinking_block():
    from pagedserve.serve_app.protocol import (
        ChatCompletionStreamResponse, ChatStreamChoice, DeltaMessage,
    )

    def chunk(finish_reason=None, **delta):
        return ChatCompletionStreamResponse(
            id="chatcmpl-9", created=0, model="m", usage=Usage(prompt_tokens=3),
            choices=[ChatStreamChoice(index=0, delta=DeltaMessage(**delta),
                                      finish_reason=finish_reason)])
    stream = anthropic_messages.MessageStream()
    events = [e for c in [chunk(reasoning_content="hmm"), chunk(reasoning_content=" ok"),
                          chunk(content="42"), chunk("stop")] for e in stream.feed(c)]
    events += stream.finish()
    final = rebuilt(events)
    assert [b.model_dump() for b in final.content] == [
        {"type": "thinking", "thinking": "hmm ok", "signature": ""},
        {"type": "text", "text": "42", "citations": None}]
    assert final.stop_reason == "end_turn"


def test_a_failure_mid_stream_is_an_error_event_that_ends_it():
    async def failing():
        yield anthropic_messages.MessageStream().feed(SimpleNamespace(
            id="chatcmpl-2", model="m", usage=None, choices=[]))[0]
        raise errors.unavailable("the engine replica died", 2)

    async def sse():
        return [e async for e in anthropic_messages.sse_events(failing())]
    events = asyncio.run(sse())
    assert events[0].startswith("event: message_start\ndata: {")
    kind, data = events[-1].removesuffix("\n\n").split("\n")
    assert kind == "event: error" and "[DONE]" not in "".join(events)
    assert json.loads(data.removeprefix("data: ")) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "the engine replica died"}}


# -- the HTTP surface: errors by route, keys -------------------------------------------------------
@pytest.fixture(scope="module")
def http():
    app = FastAPI()
    errors.install_error_handlers(app)
    app.add_middleware(FrontDoorMiddleware, api_keys=["k1"], record_status=lambda *a: None,
                       model_name=lambda: "m", max_body_bytes=4096)

    @app.post("/v1/messages")
    async def create_message(request: MessagesRequest):
        raise errors.model_not_found(request.model)

    @app.post("/v1/chat/completions")
    async def create_chat_completion():
        return {}
    return TestClient(app)


def test_messages_errors_are_anthropic_shaped_by_route(http):
    body = {"model": "claude", "max_tokens": 4, "messages": HI}
    missing = http.post("/v1/messages", headers={"x-api-key": "k1"},
                        json={k: v for k, v in body.items() if k != "max_tokens"})
    assert missing.status_code == 400
    assert missing.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Missing required parameter: 'max_tokens'."}}
    bad_block = http.post("/v1/messages", headers={"x-api-key": "k1"}, json={**body, "messages": [
        {"role": "assistant",
         "content": [{"type": "tool_use", "id": "t", "name": "n", "input": 3}]}]})
    assert bad_block.status_code == 400
    assert bad_block.json()["error"]["message"].startswith("Invalid value for "
                                                           "'messages.0.content.0.input'")
    unknown = http.post("/v1/messages", headers={"x-api-key": "k1"}, json=body)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    too_large = http.post("/v1/messages", headers={"x-api-key": "k1"},
                          json={**body, "system": "x" * 5000})
    assert too_large.status_code == 413
    assert too_large.json()["error"]["type"] == "request_too_large"
    assert "error" in http.post("/v1/chat/completions", json={}).json()  # 401, OpenAI's shape
    assert http.post("/v1/chat/completions", json={}).json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers,status", [
    ({"x-api-key": "k1"}, 404), ({"authorization": "Bearer k1"}, 404),
    ({"x-api-key": "k2"}, 401), ({"authorization": "Bearer k2", "x-api-key": "k1"}, 404),
    ({}, 401), ({"x-api-key": ""}, 401),
])
def test_keys_are_accepted_as_x_api_key_or_bearer(http, headers, status):
    response = http.post("/v1/messages", headers={"anthropic-version": "2023-06-01", **headers},
                         json={"model": "claude", "max_tokens": 4, "messages": HI})
    assert response.status_code == status
    if status == 401:
        assert response.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "Incorrect or missing API key."}}
