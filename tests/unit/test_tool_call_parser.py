"""pagedserve.serve_app.tool_call_parser: every split of a completion into deltas gives the same calls,
content and (merged) events as the whole text, and the events come as soon as the text allows."""
import itertools
import json
import random

import pytest

from pagedserve.serve_app.tool_call_parser import Arguments, CallStart, Content, ToolCallParser
from pagedserve.serve_app.tool_calls import Call, parse_calls, tool_spec

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now"}}]
AUTO, REQUIRED = tool_spec(TOOLS, "auto", None), tool_spec(TOOLS, "required", None)
SINGLE = tool_spec(TOOLS, "auto", False)
NAMED = tool_spec(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
WEATHER = '{"city": "Pa\\"ris}"}'

# (spec, text, content, calls)
CASES = [
    (NAMED, WEATHER, None, [("get_weather", WEATHER)]),
    (NAMED, "", None, [("get_weather", "")]),
    (REQUIRED, f'[{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name":"now","arguments":{{}}}}]',
     None, [("get_weather", WEATHER), ("now", "{}")]),
    (REQUIRED, '[{"name": "now", "argu', None, [("now", "")]),  # cut off by max_tokens
    (REQUIRED, '[{"na', '[{"na', []),
    (AUTO, f'Let me look.  \n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
           '</tool_call>\n<tool_call>{"name": "now"}</tool_call> bye', "Let me look.",
     [("get_weather", WEATHER), ("now", "{}")]),
    (AUTO, '<tool_call>[{"name": "now", "arguments": {"a": [1, {"b": "]}"}]}}]</tool_call>', None,
     [("now", '{"a": [1, {"b": "]}"}]}')]),
    (AUTO, ' {"name": "now", "parameters": "{\\"tz\\": \\"UTC\\"}"} ', None, [("now", '{"tz": "UTC"}')]),
    (AUTO, '{"arguments": {"city": "Oslo"}, "id": 7, "name": "get_weather"}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    (AUTO, '{"name": "now", "arguments": null}', None, [("now", "null")]),
    (AUTO, '[{"name": "now"}, {"name": "get_weather", "arguments": {}}]', None,
     [("now", "{}"), ("get_weather", "{}")]),
    (SINGLE, '[{"name": "now"}, {"name": "get_weather", "arguments": {}}]', None, [("now", "{}")]),
    (AUTO, '<tool_call>{"name": "nope"}</tool_call><tool_call>{"name": "now"}</tool_call>', None,
     [("now", "{}")]),
    # No call after all: every character comes back as content.
    (AUTO, '  {"answer": "Paris", "n": [1, 2]}', '  {"answer": "Paris", "n": [1, 2]}', []),
    (AUTO, '[1, 2] <tool_call>{"name": "now"}', '[1, 2]', [("now", "{}")]),
    (AUTO, 'ok <tool_call>{"name": "now", "arguments": {"a', 'ok', [("now", '{"a')]),
    (AUTO, '{"name": "unknown", "arguments": {}}', '{"name": "unknown", "arguments": {}}', []),
    (AUTO, 'a <tool_cal b <tool_call>{"name": "x"}</tool_call> c',
     'a <tool_cal b <tool_call>{"name": "x"}</tool_call> c', []),
    (AUTO, "Paris is the capital. <tool", "Paris is the capital. <tool", []),
    (AUTO, " \n ", " \n ", []),
    (tool_spec(TOOLS, "none", None), '{"name": "now"}', '{"name": "now"}', []),
]


def run(spec, pieces):
    parser, events = ToolCallParser(spec), []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return parser, merged(events)


def merged(events):
    out = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + event.text)
        elif isinstance(event, Arguments) and isinstance(last, Arguments) and last.index == event.index:
            out[-1] = Arguments(event.index, last.text + event.text)
        else:
            out.append(Content(event.text) if isinstance(event, Content) else event)
    return out


def splits(text, num_cuts):
    for cuts in itertools.combinations(range(1, len(text)), num_cuts):
        bounds = (0, *cuts, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("spec,text,content,calls", CASES)
def test_every_split_reads_the_same_calls(spec, text, content, calls):
    parser, whole = run(spec, [text])
    assert (parser.content, [tuple(c) for c in parser.calls]) == (content, calls)
    assert parse_calls(text, spec) == (content, [Call(*c) for c in calls])
    starts = [e for e in whole if isinstance(e, CallStart)]
    assert [(e.index, e.name) for e in starts] == [(i, name) for i, (name, _) in enumerate(calls)]
    if calls:  # content first, then each call: its start, then its arguments
        first = whole.index(starts[0])
        assert all(isinstance(e, Content) for e in whole[:first])
        assert all(not isinstance(e, Content) for e in whole[first:])
    for pieces in itertools.chain(splits(text, 1), splits(text, 2) if len(text) < 70 else ()):
        split_parser, events = run(spec, pieces)
        assert events == whole, pieces
        assert (split_parser.content, split_parser.calls) == (parser.content, parser.calls)


def test_random_token_splits_of_long_texts():
    rng = random.Random(0)
    for spec, text, _, _ in CASES:
        _, whole = run(spec, [text])
        for _ in range(200):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30)))) \
                if len(text) > 1 else []
            bounds = (0, *cuts, len(text))
            assert run(spec, [text[a:b] for a, b in zip(bounds, bounds[1:])])[1] == whole


def test_events_come_as_soon_as_the_text_allows():
    parser = ToolCallParser(REQUIRED)
    assert parser.feed('[{"name": "get_wea') == []
    assert parser.feed('ther", "arguments": {"ci') == [CallStart(0, "get_weather"),
                                                        Arguments(0, '{"ci')]
    assert parser.feed('ty": "Oslo"}}, {"name": "now"') == [Arguments(0, 'ty": "Oslo"}'),
                                                             CallStart(1, "now")]
    assert parser.feed("}]") == [Arguments(1, "{}")] and parser.finish() == []
    auto = ToolCallParser(AUTO)
    assert auto.feed("It is ") == [Content("It is")]  # the space waits: a call may follow
    assert auto.feed("sunny. <tool") == [Content(" sunny.")]
    assert auto.feed("_call>") == []
    assert auto.feed('{"arguments": {"city": "Rome"}, ') == []  # no name yet: held
    assert auto.feed('"name": "get_weather"}') == [CallStart(0, "get_weather"),
                                                   Arguments(0, '{"city": "Rome"}')]
    assert auto.finish() == [] and auto.content == "It is sunny."
    assert json.loads(auto.calls[0][1]) == {"city": "Rome"}
    named = ToolCallParser(NAMED)
    assert named.feed("") == [CallStart(0, "get_weather")] and named.feed("{") == [Arguments(0, "{")]
