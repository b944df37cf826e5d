"""ChatFormatter's streamed tool calls, without Ray: OpenAI's chunk shapes, and the `openai`
client's own stream accumulator rebuilds exactly the non-streamed answer, logprobs included."""
from __future__ import annotations

import asyncio
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pagedserve.replicas.core.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.serve_app.formatters import ChatFormatter
from pagedserve.serve_app.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
REQUIRED = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]'
AUTO = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        '<tool_call>{"name": "now", "arguments": {"tz": "CET"}}</tool_call>')


class Info:
    name, tokenizer, reasoning_parser = "m", None, None


def formatter(tool_choice, stream: bool, **logprobs) -> ChatFormatter:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=stream,
                                    tools=TOOLS, tool_choice=tool_choice, **logprobs)
    return ChatFormatter(request, Info, "chatcmpl-1", sse=True, tools=request.tool_spec())


def position(k: int, text: str) -> dict:
    """Token k's logprobs: itself (its text is `text`) ranked first, and one alternative."""
    return {k: Logprob(-0.01 * k, 1, text), 10_000 + k: Logprob(-5.0 - k, 2, f"alt{k}")}


async def deltas(text: str, size: int, finish_reason: str, tokens_per_delta: int = 1):
    """`text` in tokens of `size` characters, `tokens_per_delta` of them per output."""
    pieces = [text[k:k + size] for k in range(0, len(text), size)]
    for start in range(0, len(pieces), tokens_per_delta):
        ks = range(start, min(start + tokens_per_delta, len(pieces)))
        last = ks[-1] == len(pieces) - 1
        yield 0, RequestOutput("r", None, [], [CompletionOutput(
            0, "".join(pieces[k] for k in ks), list(ks),
            logprobs=[position(k, pieces[k]) for k in ks],
            finish_reason=finish_reason if last else None)], finished=last)


def chunks_of(f: ChatFormatter, outputs) -> list[ChatCompletionChunk]:
    async def stream():
        return [c async for c in f.stream(outputs)]

    # Content comes as ready server-sent events (str), the rest as chunk models.
    return [ChatCompletionChunk.model_validate(json.loads(
        c.removeprefix("data: ") if isinstance(c, str) else c.model_dump_json()))
        for c in asyncio.run(stream())]


@pytest.mark.parametrize("tool_choice,text,names", [
    ("required", REQUIRED, ["get_weather", "now"]),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Lima"}', ["get_weather"]),
    ("auto", AUTO, ["get_weather", "now"]),
])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_calls_rebuild_the_whole_answer(tool_choice, text, names, size):
    whole = asyncio.run(formatter(tool_choice, False).collect(deltas(text, size, "stop")))
    chunks = chunks_of(formatter(tool_choice, True), deltas(text, size, "stop"))
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)  # none asked for
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


ALL_CHOICES = [("required", REQUIRED), ("auto", AUTO), ("auto", "no call here"),
               ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Lima"}')]


@pytest.mark.parametrize("tool_choice,text", ALL_CHOICES)
@pytest.mark.parametrize("size,tokens_per_delta", [(1, 1), (3, 1), (2, 4), (1000, 1)])
@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_streamed_logprobs_join_to_the_whole_answers(tool_choice, text, size, tokens_per_delta,
                                                      finish_reason):
    """Every token's logprobs arrive once, in order, with the first chunk that sends its text
    (text the parser held back sends them later); joined they are the whole answer's, token for
    token, as the `openai` client accumulates them too."""
    asked = {"logprobs": True, "top_logprobs": 1}
    whole = asyncio.run(formatter(tool_choice, False, **asked).collect(
        deltas(text, size, finish_reason, tokens_per_delta)))
    expected = whole.choices[0].logprobs.content
    assert len(expected) == -(-len(text) // size)
    assert [t.top_logprobs[0].token for t in expected] == [t.token for t in expected]

    chunks = chunks_of(formatter(tool_choice, True, **asked),
                       deltas(text, size, finish_reason, tokens_per_delta))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in expected]
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.current_completion_snapshot.choices[0]  # the final one refuses "length"
    assert [t.model_dump() for t in final.logprobs.content] == [t.model_dump() for t in expected]

    # Where the parser holds nothing back (a named function's arguments), each fragment
    # carries exactly its own tokens.
    if isinstance(tool_choice, dict):
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.tool_calls:
                fragment = chunk.choices[0].delta.tool_calls[0].function.arguments
                carried = chunk.choices[0].logprobs
                if fragment:
                    assert "".join(t.token for t in carried.content) == fragment
                else:
                    assert carried is None


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
