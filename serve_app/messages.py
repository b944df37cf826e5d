"""Anthropic's Messages API as a door onto the chat pipeline, as vLLM serves it.

A MessagesRequest becomes a ChatCompletionRequest (the system prompt a system message, tool_use
blocks an assistant's tool_calls, tool_result blocks tool messages, tools and tool_choice their
OpenAI forms), so validation, templates, routing, limits, metrics and cancellation are the chat
route's. The chat answer is then reshaped: a whole ChatCompletionResponse into a message, a stream
of chat chunks into Anthropic's events (`MessageStream`).
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from pydantic import ValidationError

from pagedserve.serve_app import errors
from pagedserve.serve_app.answer_blocks import (
    REASONING, TEXT, AnswerBlocks, BlockDelta, BlockEvent, BlockStart,
)
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse, ChatMessage,
    StreamOptions, TextPart, Usage,
)
from pagedserve.serve_app.sse import named_event
from pagedserve.serve_app.protocol.messages import (
    ContentBlockDelta, ContentBlockStart, ContentBlockStop, CountTokensRequest, InputJsonDelta,
    MessageDelta, MessageParam, MessagesRequest, MessagesResponse, MessageStart, MessageStop,
    MessageUsage, OutputUsage, Ping, StopDelta, StreamEvent, TextBlock, TextDelta, TextOut,
    ThinkingBlock, ThinkingDelta, ThinkingOut, ToolResultBlock, ToolUseBlock, ToolUseOut,
)

logger = logging.getLogger(__name__)

# Chat fields that carry a Messages field under another name: errors name the Messages one.
RENAMED_PARAMS = {"stop": "stop_sequences", "user": "metadata.user_id",
                   "response_format": "output_config.format"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


# -- request -------------------------------------------------------------------------------------
def chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request stands for; OpenAIError naming the
    Messages field for what the chat route cannot take."""
    messages = []
    if request.system:
        messages.append(ChatMessage(role="system", content=_joined(request.system)))
    for i, message in enumerate(request.messages):
        messages += _chat_messages(message, f"messages.{i}")
    fields = dict(model=request.model, messages=messages)
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description else {})}}
            for tool in request.tools]
    choice = request.tool_choice
    if choice is not None and (request.tools or choice.type not in ("auto", "none")):
        fields["tool_choice"] = _TOOL_CHOICES.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if request.output_config is not None and request.output_config.format is not None:
        fields["response_format"] = _response_format(request.output_config.format)
    last = request.messages[-1]
    if last.role == "assistant" and not any(isinstance(b, ToolUseBlock) for b in last.content):
        # Anthropic's prefill: the answer continues the final assistant message.
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(request, MessagesRequest):
        fields.update(max_tokens=request.max_tokens, stop=request.stop_sequences,
                      temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                      stream=request.stream)
        user = (request.metadata or {}).get("user_id")
        if isinstance(user, str):
            fields["user"] = user
        if request.stream:  # usage on every chunk: message_start carries the input tokens
            fields["stream_options"] = StreamOptions(include_usage=True,
                                                     continuous_usage_stats=True)
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        raise errors.renamed(errors.from_validation_error(exc.errors()), RENAMED_PARAMS) from None


def _chat_messages(message: MessageParam, where: str) -> list[ChatMessage]:
    """One Messages turn as chat messages: its tool results become tool messages, in order."""
    out, texts, calls = [], [], []
    for j, block in enumerate(message.content):
        at = f"{where}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(TextPart(type="text", text=block.text))
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise errors.bad_request("tool_use blocks belong in assistant messages", at)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise errors.bad_request("tool_result blocks belong in user messages", at)
            if texts:
                out.append(ChatMessage(role="user", content=texts))
                texts = []
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                   content=_tool_result_text(block, at)))
        elif not isinstance(block, ThinkingBlock):  # earlier reasoning is not shown again
            raise _unsupported(block.type, f"{at}.type")
    if texts or calls or not out:
        out.append(ChatMessage(role=message.role, content=texts, tool_calls=calls or None))
    return out


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    for k, part in enumerate(block.content or []):
        if not isinstance(part, TextBlock):
            raise _unsupported(part.type, f"{where}.content.{k}.type")
    return _joined(block.content or [])


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _unsupported(kind: str, param: str) -> OpenAIError:
    return errors.bad_request(f"{kind!r} content blocks are not supported; send text, tool_use "
                              f"and tool_result blocks", param)


def _response_format(output_format: dict) -> dict:
    if output_format.get("type") != "json_schema" or not isinstance(output_format.get("schema"),
                                                                     dict):
        raise errors.bad_request("output_config.format must be {'type': 'json_schema', "
                                 "'schema': {...}}", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output",
                                                   "schema": output_format["schema"]}}


# -- response ------------------------------------------------------------------------------------
def message_response(response: ChatCompletionResponse) -> MessagesResponse:
    """A whole chat answer as a message: thinking, then text, then tool_use blocks."""
    choice = response.choices[0]
    message, content = choice.message, []
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning:
        content.append(ThinkingOut(thinking=reasoning))
    if message.content:
        content.append(TextOut(text=message.content))
    for call in message.tool_calls or []:
        content.append(ToolUseOut(id=tool_use_id(call.id), name=call.function.name,
                                  input=tool_input(call.function.arguments)))
    stop_reason, stop_sequence = stop_fields(choice.finish_reason, choice.stop_reason)
    return MessagesResponse(id=_message_id(response.id), model=response.model, content=content,
                            stop_reason=stop_reason, stop_sequence=stop_sequence,
                            usage=message_usage(response.usage))


def stop_fields(finish_reason: str | None, stop_reason: int | str | None
                ) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for a chat finish: a matched stop string is a stop sequence;
    the end-of-sequence token (or a stop token id) ends the turn."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return ("end_turn", None) if finish_reason is not None else (None, None)


def message_usage(usage: Usage | None, num_output: int | None = None) -> MessageUsage:
    if usage is None:
        return MessageUsage()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return MessageUsage(input_tokens=usage.prompt_tokens - cached, cache_read_input_tokens=cached,
                        output_tokens=usage.completion_tokens if num_output is None else num_output)


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a chat tool call: the same random part, under its own prefix."""
    return f"toolu_{call_id.removeprefix('call-')}"


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is; {} when they are not one (a call
    cut off by max_tokens: the stream's input_json_delta fragments still carry the text)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _message_id(chat_id: str) -> str:
    return f"msg_{chat_id.removeprefix('chatcmpl-')}"


# -- stream --------------------------------------------------------------------------------------
class MessageStream:
    """Anthropic's stream events from chat chunks, one chunk at a time: message_start and a ping,
    then per content block (`answer_blocks`) its start, deltas and stop, then message_delta (stop
    reason, output tokens) and message_stop from `finish`."""

    def __init__(self):
        self.started = False
        self.blocks = AnswerBlocks()
        self.num_blocks = 0

    def feed(self, chunk: ChatCompletionStreamResponse) -> list[StreamEvent]:
        events = []
        if not self.started:
            self.started = True
            start = MessagesResponse(id=_message_id(chunk.id), model=chunk.model, content=[],
                                     usage=message_usage(chunk.usage, num_output=0))
            events += [MessageStart(message=start), Ping()]
        return events + [self._render(block) for block in self.blocks.feed(chunk)]

    def finish(self) -> list[StreamEvent]:
        events = [self._render(block) for block in self.blocks.close()]
        usage = self.blocks.usage
        stop_reason, stop_sequence = stop_fields(self.blocks.finish_reason, self.blocks.stop_reason)
        return [*events,
                MessageDelta(delta=StopDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
                             usage=OutputUsage(output_tokens=usage.completion_tokens
                                               if usage is not None else 0)),
                MessageStop()]

    def _render(self, block: BlockEvent) -> StreamEvent:
        if isinstance(block, BlockStart):
            self.num_blocks += 1
            start = (ThinkingOut(thinking="") if block.kind == REASONING else
                     TextOut(text="") if block.kind == TEXT else
                     ToolUseOut(id=tool_use_id(block.call_id), name=block.name, input={}))
            return ContentBlockStart(index=self.num_blocks - 1, content_block=start)
        if isinstance(block, BlockDelta):
            delta = (ThinkingDelta(thinking=block.text) if block.kind == REASONING else
                     TextDelta(text=block.text) if block.kind == TEXT else
                     InputJsonDelta(partial_json=block.text))
            return ContentBlockDelta(index=self.num_blocks - 1, delta=delta)
        return ContentBlockStop(index=self.num_blocks - 1)


async def message_events(chunks: AsyncIterator[ChatCompletionStreamResponse]
                         ) -> AsyncIterator[StreamEvent]:
    stream = MessageStream()
    try:
        async for chunk in chunks:
            for event in stream.feed(chunk):
                yield event
        for event in stream.finish():
            yield event
    finally:
        await chunks.aclose()  # a client that left: the chat stream aborts its request


def sse_event(event: StreamEvent) -> str:
    return named_event(event.type, event.model_dump_json())


def error_event(exc: OpenAIError) -> str:
    return named_event("error", json.dumps(errors.anthropic_error_body(exc)))


async def sse_events(events: AsyncIterator[StreamEvent]) -> AsyncIterator[str]:
    """The events as server-sent events; a failure after the stream started is an error event,
    which ends the stream (Anthropic's streams have no terminator of their own)."""
    try:
        async for event in events:
            yield sse_event(event)
    except OpenAIError as exc:
        yield error_event(exc)
    except Exception as exc:  # noqa: BLE001 - a bug after the stream started: tell the client
        logger.exception("messages stream failed")
        yield error_event(errors.internal_error(exc))
    finally:
        await events.aclose()
