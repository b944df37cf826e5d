"""The Responses door's parts without a server: input items to chat messages, a request to its
chat request (errors keep the Responses field names), chat chunks to typed events in order, a
failure after the start as an error event, and the bounded store."""
import asyncio

import pytest

from pagedserve.serve_app import response_items
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.protocol import (
    ChatCompletionStreamResponse, ChatStreamChoice, CompletionTokensDetails, DeltaFunctionCall, DeltaMessage,
    DeltaToolCall, PromptTokensDetails, Usage,
)
from pagedserve.serve_app.protocol.responses import ResponsesRequest
from pagedserve.serve_app.response_store import ResponseStore
from pagedserve.serve_app.response_stream import ResponseEvents
from pagedserve.serve_app.responses_api import ResponsesDoor


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **fields})


def test_input_items_become_chat_messages():
    messages = response_items.input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "add"}]},
        {"type": "reasoning", "id": "rs-1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
    ])
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "add"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]


def test_chat_request_translates_fields_and_continues_history():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat, conversation = response_items.chat_request(request(
        input="more", instructions="be brief", max_output_tokens=9, stream=True,
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        include=["message.output_text.logprobs"], top_logprobs=2), history)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert conversation == [*history, {"role": "user", "content": "more"}]  # no instructions
    assert (chat.max_tokens, chat.stream, chat.include_usage) == (9, True, True)
    assert chat.tools == [{"type": "function", "function": {"name": "f",
                                                             "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format["json_schema"]["schema"] == {"type": "object"}
    assert (chat.logprobs, chat.top_logprobs) == (True, 2)


@pytest.mark.parametrize("fields,param", [
    ({"background": True}, "background"),
    ({"conversation": "conv-1"}, "conversation"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": [{"role": "user", "content": "x"}], "top_logprobs": 1,
      "include": ["message.output_text.logprobs"], "temperature": 0, "n": 2}, "n"),
])
def test_what_cannot_be_done_is_refused_by_name(fields, param):
    with pytest.raises((OpenAIError, ValueError)) as info:
        response_items.chat_request(request(**{"input": "x", **fields}), [])
    if isinstance(info.value, OpenAIError):
        assert info.value.param == param and info.value.status_code == 400
    else:  # pydantic: the request model itself refused the field
        assert param in str(info.value)


def chunk(delta: DeltaMessage, finish_reason=None, usage=None) -> ChatCompletionStreamResponse:
    choices = [] if delta is None else [ChatStreamChoice(index=0, delta=delta,
                                                         finish_reason=finish_reason)]
    return ChatCompletionStreamResponse(id="c", created=0, model="m", choices=choices, usage=usage)


async def chunks(items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def run(agen):
    async def collect():
        return [e async for e in agen]
    return asyncio.run(collect())


def test_events_follow_openais_order_for_each_item():
    usage = Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=3),
                  completion_tokens_details=CompletionTokensDetails(reasoning_tokens=3))
    start = DeltaToolCall(index=0, id="call-1", type="function",
                          function=DeltaFunctionCall(name="f", arguments=""))
    stream = [chunk(DeltaMessage(role="assistant", content="")),
              chunk(DeltaMessage(reasoning_content="let me ")), chunk(DeltaMessage(reasoning_content="see")),
              chunk(DeltaMessage(content="Hi")), chunk(DeltaMessage(tool_calls=[start])),
              chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(
                  arguments='{"a":'))])),
              chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(
                  arguments=' 1}'))])),
              chunk(DeltaMessage(), finish_reason="tool_calls"), chunk(None, usage=usage)]
    response = response_items.new_response(request(input="x"))
    stream_events = ResponseEvents(response)
    events = run(stream_events.events(chunks(stream))) + [stream_events.completed()]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == '{"a": 1}'
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 3
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [item["id"] for item in final["output"]]


def test_a_failure_after_the_start_is_an_error_event_and_nothing_is_stored():
    class Store:
        def __getattr__(self, name):
            raise AssertionError("a failed response must not be stored")

    async def chat(_):
        return chunks([chunk(DeltaMessage(content="a")),
                       OpenAIError("the engine failed", 503, code="service_unavailable")])

    door = ResponsesDoor(chat, Store(), 1)
    events = run(asyncio.run(door.create(request(input="x", stream=True))))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "service_unavailable"
    assert events[-1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    sse_events = run(asyncio.run(door.create(request(input="x", stream=True), sse_events=True)))
    assert sse_events[0].startswith("event: response.created\ndata: {")


def test_store_bounds_entries_bytes_and_time():
    now = [0.0]
    store = ResponseStore(max_entries=2, max_bytes=10, ttl_s=5, clock=lambda: now[0])

    def call(method, *args):
        return asyncio.run(getattr(store, method)(*args))

    assert call("put", "a", b"1234") and call("put", "b", b"1234")
    assert call("get", "a") == b"1234"  # a is now the most recently used
    call("put", "c", b"12")
    assert (call("get", "b"), call("get", "a"), call("get", "c")) == (None, b"1234", b"12")
    call("put", "d", b"123456")  # over max_bytes with a and c: the least recent go
    assert call("get", "a") is None and call("get", "d") == b"123456"
    assert not call("put", "e", b"x" * 11) and call("get", "e") is None
    now[0] = 6.0
    assert call("get", "d") is None and call("stats")["num_entries"] == 1
    assert call("delete", "c") and not call("delete", "c")
    assert call("stats") == {"num_entries": 0, "num_bytes": 0}
    assert not asyncio.run(ResponseStore(max_entries=0).put("f", b"1"))  # nothing is kept


def test_a_streamed_response_is_stored_before_its_last_event():
    stored = {}

    class Method:
        def __init__(self, fn):
            self.remote = fn

    class Store:
        async def _put(response_id, blob):
            stored[response_id] = blob
            return True
        put = Method(_put)

    async def chat(_):
        return chunks([chunk(DeltaMessage(content="a")), chunk(DeltaMessage(), finish_reason="stop")])

    async def main():
        events = await ResponsesDoor(chat, Store(), 1).create(
            request(input="x", stream=True))
        async for event in events:
            if event["type"] == "response.completed":
                return event["response"]["id"] in stored

    assert asyncio.run(main())
