"""The Responses API in terms of chat: input items to chat messages, a Responses request to the
chat request the ingress runs, and a finished chat answer to output items.

The door adds no pipeline of its own: the chat route's validation, template, tools, grammars,
limits, routing and metrics serve it. What Responses names differently is translated here, and
errors keep the Responses field names (`input[2].type`, `text.format`, `max_output_tokens`).
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagedserve.serve_app import errors
from pagedserve.serve_app.protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedserve.serve_app.protocol.responses import (
    FunctionCallItem, InputTokensDetails, OutputMessage, OutputText, OutputTokensDetails,
    ReasoningItem, ReasoningText, ResponseObject, ResponsesRequest, ResponseUsage,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
# Chat's names for the fields a Responses request names otherwise.
CHAT_NAMES = {"max_tokens": "max_output_tokens", "messages": "input",
               "response_format": "text.format"}
# Fields the chat request takes as they are.
_SAME_FIELDS = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "top_k", "min_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                "ignore_eos", "min_tokens", "priority", "chat_template_kwargs", "user", "metadata")


def refuse_unsupported(request: ResponsesRequest) -> None:
    """What this server cannot do for a request is a 400 naming the field, never ignored."""
    if request.background:
        raise errors.bad_request("background mode is not supported: send the request without "
                                 "background and keep the connection (or stream)", "background")
    if request.conversation is not None:
        raise errors.bad_request("conversations are not supported; chain responses with "
                                 "previous_response_id", "conversation")
    if request.prompt is not None:
        raise errors.bad_request("prompt templates are not supported; send input", "prompt")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for input items: messages, function calls (an assistant's tool_calls, one
    message per run of calls) and their outputs (tool messages); reasoning items are dropped, as
    chat templates drop earlier thinking."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise errors.bad_request(f"role must be one of {', '.join(_ROLES)}; got {role!r}",
                                         f"input[{i}].role")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i),
                                 "arguments": _field(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":
            continue
        else:
            raise errors.bad_request(f"input items of type {kind!r} are not supported (message, "
                                     f"function_call, function_call_output, reasoning)",
                                     f"input[{i}].type")
    return messages


def _text(content, param: str) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.bad_request("content must be text or a list of text parts", param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise errors.bad_request(f"content parts of type {kind!r} are not supported: this "
                                     f"model reads text", f"{param}.content[{j}].type")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _field(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise errors.bad_request(f"{item.get('type')} items need a string {name}",
                                 f"input[{i}].{name}")
    return value


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's nested ones; built-in tools are refused."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise errors.bad_request(f"tools of type {tool.get('type')!r} are not supported: "
                                     f"only function tools run here", f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise errors.bad_request("tool_choice must be auto, none, required or "
                             "{'type': 'function', 'name': ...}", "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise errors.bad_request("text.format must be an object with a type", "text.format")
    if fmt is None or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise errors.bad_request("text.format json_schema needs a schema object",
                                     "text.format.schema")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt["schema"],
            "strict": fmt.get("strict")}}
    raise errors.bad_request(f"text.format type must be text, json_object or json_schema, got "
                             f"{fmt.get('type')!r}", "text.format.type")


def chat_request(request: ResponsesRequest, history: list[dict[str, Any]]
                 ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request for a Responses request continuing `history` (the earlier turns'
    messages), and this turn's conversation to store (instructions are not carried over, as
    OpenAI's `previous_response_id` does not carry them)."""
    refuse_unsupported(request)
    conversation = [*history, *input_messages(request.input)]
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    fields = {name: getattr(request, name) for name in _SAME_FIELDS
              if getattr(request, name) is not None}
    fields.update(messages=system + conversation, max_tokens=request.max_output_tokens,
                  tools=chat_tools(request.tools), tool_choice=chat_tool_choice(request.tool_choice),
                  response_format=response_format(request.text))
    if request.stream:
        fields["stream_options"] = {"include_usage": True}
    if LOGPROBS_INCLUDE in (request.include or []):
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.tools and request.tool_choice is None:
        fields["tool_choice"] = "auto"
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}), conversation
    except ValidationError as exc:
        raise errors.renamed(errors.from_validation_error(exc.errors()), CHAT_NAMES) from None


def new_response(request: ResponsesRequest) -> ResponseObject:
    """The response object before any output: the request's settings echoed, as OpenAI does.
    Its model is the one the chat route resolved, set from the answer's first chunk (or the
    whole answer) before any event or result shows it."""
    return ResponseObject(
        status="in_progress", model="", instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        previous_response_id=request.previous_response_id, temperature=request.temperature,
        top_p=request.top_p, tools=request.tools or [], tool_choice=request.tool_choice or "auto",
        parallel_tool_calls=request.parallel_tool_calls is not False,
        text=request.text or {"format": {"type": "text"}}, store=request.store,
        metadata=request.metadata, reasoning=request.reasoning,
        truncation=request.truncation or "disabled", user=request.user)


def finish(response: ResponseObject, finish_reason: str | None, usage) -> None:
    """Status, incomplete details and usage of a response whose output is complete."""
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = {"reason": "max_output_tokens"}
    else:
        response.status = "completed"
    if usage is not None:
        cached = usage.prompt_tokens_details
        thought = usage.completion_tokens_details
        response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=cached.cached_tokens if cached is not None else 0),
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=thought.reasoning_tokens if thought is not None else 0))


def completed(response: ResponseObject, answer: ChatCompletionResponse) -> ResponseObject:
    """A whole chat answer as output items: its thinking, its text, its function calls (the
    order and the items a stream of it makes)."""
    choice = answer.choices[0]
    message = choice.message
    if message.reasoning_content:
        response.output.append(ReasoningItem(content=[ReasoningText(text=message.reasoning_content)]))
    if message.content or not message.tool_calls:
        logprobs = None
        if choice.logprobs is not None and choice.logprobs.content is not None:
            logprobs = [p.model_dump() for p in choice.logprobs.content]
        response.output.append(OutputMessage(content=[OutputText(text=message.content or "",
                                                                 logprobs=logprobs)]))
    for call in message.tool_calls or []:
        response.output.append(FunctionCallItem(call_id=call.id, name=call.function.name,
                                                arguments=call.function.arguments))
    finish(response, choice.finish_reason, answer.usage)
    response.model = answer.model
    return response


def assistant_message(response: ResponseObject) -> dict[str, Any]:
    """A response's output as the chat message a later turn continues from."""
    text = "".join(part.text for item in response.output if isinstance(item, OutputMessage)
                   for part in item.content)
    calls = [{"id": item.call_id, "type": "function",
              "function": {"name": item.name, "arguments": item.arguments}}
             for item in response.output if isinstance(item, FunctionCallItem)]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message
