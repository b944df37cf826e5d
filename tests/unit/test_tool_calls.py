"""pagedserve.serve_app.tool_calls: checking tools and tool_choice, the forcing grammar, reading calls."""
import json

import pytest

from pagedserve.replicas.core.sampling_params import ParamError
from pagedserve.serve_app.tool_calls import (
    parse_calls, template_messages, tool_constraint, tool_spec,
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


@pytest.mark.parametrize("tools,choice,param", [
    (None, "required", "tool_choice"),
    ([{"type": "function"}], None, "tools"),
    ([{"type": "retrieval", "function": {"name": "x"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "x", "parameters": []}}], None, "tools"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
])
def test_bad_tools_name_their_field(tools, choice, param):
    with pytest.raises(ParamError) as info:
        tool_spec(tools, choice, None)
    assert info.value.param == param


def test_modes_and_their_grammars():
    assert tool_spec(None, None, None) is None and tool_spec(None, "none", None) is None
    auto = tool_spec(TOOLS, None, None)
    assert auto.mode == "auto" and tool_constraint(auto) is None
    assert tool_constraint(tool_spec(TOOLS, "none", None)) is None
    named = tool_spec(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert tool_constraint(named).json == TOOLS[0]["function"]["parameters"]
    assert tool_constraint(named).source == "tools"
    required = tool_constraint(tool_spec(TOOLS, "required", None)).json
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    names = [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]]
    assert names == ["get_weather", "now"]
    assert required["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    single = tool_constraint(tool_spec(TOOLS, "required", False)).json
    assert single["maxItems"] == 1


def test_parse_calls_in_each_mode():
    named = tool_spec(TOOLS, {"type": "function", "function": {"name": "now"}}, None)
    assert parse_calls('{"tz": "UTC"}', named)[1][0].arguments == '{"tz": "UTC"}'
    required = tool_spec(TOOLS, "required", None)
    content, calls = parse_calls('[{"name": "now", "arguments": {}}, '
                                 '{"name": "get_weather", "arguments": {"city": "Oslo"}}]', required)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("now", {}), ("get_weather", {"city": "Oslo"})]
    # Cut off by max_tokens: the call keeps what was generated (a stream has sent it already).
    assert parse_calls('[{"name": "now", "argu', required)[1][0].arguments == ""
    assert parse_calls('[{"na', required) == ('[{"na', [])
    auto = tool_spec(TOOLS, "auto", None)
    content, calls = parse_calls('Let me look.<tool_call>\n{"name": "get_weather", '
                                 '"arguments": {"city": "Paris"}}\n</tool_call>', auto)
    assert content == "Let me look." and calls[0].name == "get_weather"
    content, calls = parse_calls(' {"name": "now", "parameters": "{}"} ', auto)  # Llama 3 style
    assert content is None and calls[0].arguments == "{}"
    assert parse_calls('{"name": "unknown", "arguments": {}}', auto)[1] == []
    assert parse_calls("Paris is the capital.", auto) == ("Paris is the capital.", [])
    assert parse_calls('{"name": "now"}', tool_spec(TOOLS, "none", None))[1] == []


def test_template_messages_for_templates_with_and_without_tools():
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": "12C", "tool_call_id": "call_1"}]
    aware = template_messages(history, TOOLS, "{{ tools }} {{ message.tool_calls }}")
    assert aware[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert aware[1]["content"] == "" and aware[2]["tool_call_id"] == "call_1" and len(aware) == 3
    plain = template_messages(history, TOOLS, "{{ message['content'] }}")
    assert plain[0]["role"] == "system" and "get_weather" in plain[0]["content"]
    assert plain[2]["content"].startswith("<tool_call>") and "tool_calls" not in plain[2]
    with_system = template_messages([{"role": "system", "content": "Be brief."}] + history, TOOLS,
                                    "")
    assert with_system[0]["content"].startswith("Be brief.") and len(with_system) == 4
