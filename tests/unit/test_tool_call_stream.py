"""ChatFormatter's streamed tool calls, without Ray: OpenAI's chunk shapes, and the `openai`
client's own stream accumulator rebuilds exactly the non-streamed answer."""
from __future__ import annotations

import asyncio
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from replicas.outputs import CompletionOutput, RequestOutput
from serve_app.formatters import ChatFormatter
from serve_app.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
REQUIRED = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]'
AUTO = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        '<tool_call>{"name": "now", "arguments": {"tz": "CET"}}</tool_call>')


class Info:
    name, tokenizer = "m", None


def formatter(tool_choice, stream: bool) -> ChatFormatter:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=stream,
                                    tools=TOOLS, tool_choice=tool_choice)
    return ChatFormatter(request, Info, "chatcmpl-1", sse=True, tools=request.tool_spec())


async def deltas(text: str, size: int, finish_reason: str):
    pieces = [text[k:k + size] for k in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        yield 0, RequestOutput("r", None, [], [CompletionOutput(
            0, piece, [k], finish_reason=finish_reason if last else None)], finished=last)


@pytest.mark.parametrize("tool_choice,text,names", [
    ("required", REQUIRED, ["get_weather", "now"]),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Lima"}', ["get_weather"]),
    ("auto", AUTO, ["get_weather", "now"]),
])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_calls_rebuild_the_whole_answer(tool_choice, text, names, size):
    whole = asyncio.run(formatter(tool_choice, False).collect(deltas(text, size, "stop")))

    async def stream():
        return [c async for c in formatter(tool_choice, True).stream(deltas(text, size, "stop"))]

    # Content comes as ready server-sent events (str), the rest as chunk models.
    chunks = [ChatCompletionChunk.model_validate(json.loads(
        c.removeprefix("data: ") if isinstance(c, str) else c.model_dump_json()))
        for c in asyncio.run(stream())]
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    expected = whole.choices[0]
    assert final.finish_reason == expected.finish_reason == "tool_calls"
    assert [c.function.name for c in expected.message.tool_calls] == names
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in expected.message.tool_calls]
    assert (final.message.content or None) == expected.message.content
    assert expected.message.content == ("Checking." if tool_choice == "auto" else None)

    # OpenAI's shape: a call's id, type and name once, with empty arguments, then fragments.
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    for index in range(len(names)):
        mine = [d for d in calls if d.index == index]
        assert mine[0].id and mine[0].type == "function" and mine[0].function.name == names[index]
        assert mine[0].function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in mine[1:])
        fragments = [d.function.arguments for d in mine[1:]]
        assert "".join(fragments) == expected.message.tool_calls[index].function.arguments
        assert len(fragments) > 1 or size == 1000  # incremental, not one piece at the end
    assert [d.index for d in calls] == sorted(d.index for d in calls)  # one call after another


def test_a_call_cut_off_keeps_its_arguments_and_finish_reason():
    text = '[{"name": "get_weather", "arguments": {"ci'
    whole = asyncio.run(formatter("required", False).collect(deltas(text, 4, "length")))
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.tool_calls[0].function.arguments == '{"ci'


def test_each_choice_of_n_streams_its_own_calls():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True, n=2,
                                    tools=TOOLS, tool_choice="auto")
    texts = ['{"name": "now", "arguments": {"a": 1}}', "plain words"]

    async def interleaved():
        for k in range(0, 40, 5):
            yield 0, RequestOutput("r", None, [], [CompletionOutput(
                c, texts[c][k:k + 5], [k], finish_reason="stop" if k + 5 >= len(texts[c]) else None)
                for c in range(2) if k < len(texts[c])])

    async def stream():
        f = ChatFormatter(request, Info, "chatcmpl-1", tools=request.tool_spec())
        return [c async for c in f.stream(interleaved())]

    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in asyncio.run(stream()):
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(chunk.model_dump_json())))
    first, second = state.get_final_completion().choices
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    assert first.message.tool_calls[0].function.arguments == '{"a": 1}'
    assert second.message.content == "plain words" and not second.message.tool_calls
