"""Streamed tool calls through the real server, for every tool_choice mode: the `openai` client
sees each call's id and name first, then its arguments fragment by fragment, and what it
accumulates equals the non-streamed answer; the client's `.stream()` helper and LangChain's
streaming parse them."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import API_KEY, MODEL_NAME

# Small: the tiny model's context is 512 tokens, and the tools are listed in its prompt.
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}}}
CLOCK = {"type": "function", "function": {
    "name": "now", "parameters": {"type": "object", "additionalProperties": False,
                                  "required": ["tz"], "properties": {"tz": {"enum": ["UTC"]}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
MESSAGES = [{"role": "user", "content": "Hi"}]
# "auto" leaves the model free; this regex makes the random model write what a tool-calling
# model would: a sentence, then two Hermes-style calls.
AUTO_TEXT = (r'Ok\. <tool_call>\{"name": "weather", "arguments": \{"city": "[a-z]{2}"\}\}'
             r'</tool_call>\n<tool_call>\{"name": "now", "arguments": \{"tz": "UTC"\}\}</tool_call>')


def accumulate(stream):
    """What a client rebuilds from the stream: content, calls by index, finish reason; and
    each call's deltas, to check their shape."""
    content, calls, deltas, finish = "", {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            deltas.setdefault(delta.index, []).append(delta)
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, deltas, finish


@pytest.mark.parametrize("tool_choice,extra,num_calls", [
    ("required", {}, None),  # seeded sampling: the same text streamed or not
    ({"type": "function", "function": {"name": "now"}}, {}, 1),
    ("auto", {"structured_outputs": {"regex": AUTO_TEXT}}, 2),
])
def test_streamed_calls_equal_the_whole_answer(client, tool_choice, extra, num_calls):
    args = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=145,
                temperature=1.0, seed=1, tool_choice=tool_choice, extra_body=extra)
    whole = client.chat.completions.create(**args).choices[0]
    content, calls, deltas, finish = accumulate(client.chat.completions.create(**args, stream=True))

    assert finish == whole.finish_reason
    expected = whole.message.tool_calls
    assert num_calls is None or len(expected) == num_calls
    assert sorted(calls) == list(range(len(expected)))
    for index, call in enumerate(expected):
        assert calls[index] == {"name": call.function.name, "arguments": call.function.arguments}
        first, *rest = deltas[index]
        assert first.id and first.type == "function" and first.function.name == call.function.name
        # How many fragments arrive depends on timing: an ingress that fell behind the engine
        # sends the pending tokens as one delta (by design). That the parser streams arguments
        # piece by piece is pinned with fixed delta sizes in tests/unit/test_tool_call_stream.py.
        assert first.function.arguments == "" and rest
        assert all(d.id is None and d.function.name is None for d in rest)
        if finish == "tool_calls":
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert (content or None) == whole.message.content
    if tool_choice == "auto":
        assert finish == "tool_calls" and content == "Ok."


def test_streamed_calls_carry_the_whole_answers_logprobs(client):
    args = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=60,
                temperature=0, tool_choice="required", logprobs=True, top_logprobs=2)
    response = client.chat.completions.create(**args)
    chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
    assert any(c.choices[0].delta.tool_calls and c.choices[0].logprobs for c in chunks)
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    expected = response.choices[0].logprobs.content
    assert len(expected) == response.usage.completion_tokens > 10
    assert [t.token for t in streamed] == [t.token for t in expected]
    assert [[a.token for a in t.top_logprobs] for t in streamed] == \
        [[a.token for a in t.top_logprobs] for t in expected]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in expected], abs=1e-4)


class Weather(BaseModel):
    city: str = Field(pattern="^[a-z]{1,6}$")
    unit: Literal["C", "F"]


def test_sdk_stream_helper_and_langchain_parse_streamed_calls(app, client):
    import openai

    tool = openai.pydantic_function_tool(Weather, name="weather")
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, tools=[tool],
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=80, temperature=0) as stream:
        fragments = [e.arguments_delta for e in stream
                     if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    assert isinstance(call.function.parsed_arguments, Weather)
    assert "".join(fragments) == call.function.arguments and len(fragments) > 2

    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL_NAME, base_url=f"{app.base_url}/v1", api_key=API_KEY,
                     max_tokens=80, temperature=0, max_retries=0, streaming=True)
    chunks = list(llm.bind_tools([WEATHER], tool_choice="weather").stream(
        [HumanMessage("Weather in Oslo?")]))
    message = sum(chunks[1:], chunks[0])
    assert sum(bool(c.tool_call_chunks) for c in chunks) > 2
    (tool_call,) = message.tool_calls
    assert tool_call["name"] == "weather"
    jsonschema.validate(tool_call["args"], WEATHER["function"]["parameters"])
