"""Chat tool calls: checking `tools` / `tool_choice`, the grammar that enforces a call, the
messages a chat template sees, and reading calls back out of the generated text.

`tool_choice` "required" constrains the output to a JSON array of {"name", "arguments"} calls,
each matching its function's parameters schema; a named function constrains it to that
function's arguments object. "auto" leaves the model free and reads a call where it wrote one:
Hermes-style `<tool_call>{...}</tool_call>` blocks, or the whole text as a JSON call (or list of
calls) `{"name": ..., "arguments": {...}}`. Whole answers and streams are read by one incremental
parser (serve_app/tool_call_parser.py), so both give the same calls.
A template that knows nothing of tools is given them in a system message, in that format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pagedserve.replicas.core.sampling_params import ParamError, StructuredOutputsParams
from pagedserve.serve_app.tool_call_parser import ToolCallParser

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True)
class ToolSpec:
    """A request's checked tools and choice: mode is "none" | "auto" | "required" | "named"."""

    functions: dict[str, dict]  # name -> parameters schema
    descriptions: dict[str, str]
    mode: str
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def tool_spec(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None
              ) -> ToolSpec | None:
    """Check `tools` and `tool_choice` (ParamError naming the field); None without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ParamError("tool_choice", "tool_choice needs tools")
        return None
    functions, descriptions = {}, {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise ParamError("tools", "each tool must be {'type': 'function', 'function': "
                             "{'name': ..., 'parameters': {...}}}")
        parameters = function.get("parameters")
        parameters = ANY_OBJECT if parameters is None else parameters
        if not isinstance(parameters, dict):
            raise ParamError("tools", f"tool {function['name']!r}: parameters must be a JSON schema")
        functions[function["name"]] = parameters
        descriptions[function["name"]] = function.get("description") or ""
    named = None
    if tool_choice is None:
        mode = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ParamError("tool_choice", "tool_choice must be none, auto, required or "
                             "{'type': 'function', 'function': {'name': ...}}")
        mode = tool_choice
    else:
        named = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or named not in functions:
            raise ParamError("tool_choice", f"tool_choice names no function of tools: {named!r}")
        mode = "named"
    return ToolSpec(functions, descriptions, mode, named, parallel_tool_calls is not False)


def tool_constraint(spec: ToolSpec) -> StructuredOutputsParams | None:
    """The grammar that makes the output a valid call, for required and named choices."""
    if spec.mode == "named":
        return StructuredOutputsParams(json=spec.functions[spec.named], source="tools")
    if spec.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, params in spec.functions.items()]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
              "minItems": 1}
    if not spec.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, source="tools")


def parse_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[Call]]:
    """(content left over, calls) from a finished completion's text: what a stream of it sends."""
    if spec.mode == "none":
        return text, []
    parser = ToolCallParser(spec)
    parser.feed(text)
    parser.finish()
    return parser.content, [Call(name, arguments) for name, arguments in parser.calls]


# -- what the chat template sees -----------------------------------------------------------------
def template_messages(messages: list[dict], tools: list[dict] | None, template: str) -> list[dict]:
    """HF chat-template messages: an assistant's calls with their arguments as objects, tool
    results with their call id. A template that does not render tools gets them as text."""
    knows_tools = "tools" in template
    knows_calls = "tool_calls" in template
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            calls = [_template_call(c) for c in calls]
            if knows_calls:
                message["tool_calls"] = calls
            else:
                text = "\n".join(f"<tool_call>\n{json.dumps(c['function'], ensure_ascii=False)}"
                                 f"\n</tool_call>" for c in calls)
                message["content"] = f"{message.get('content') or ''}{text}"
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    if tools and not knows_tools:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def tools_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False, separators=(",", ":"))
                       for t in tools)
    return (f"Functions you may call:\n{listed}\nTo call one, reply with "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call>')


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI sends JSON text; templates iterate an object
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "type": call.get("type", "function"), "function": function}
