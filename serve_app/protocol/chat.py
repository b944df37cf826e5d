"""/v1/chat/completions: messages, the request (tools, chat template), the response, and the
stream's deltas (which drop unset fields, as OpenAI's do)."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer, model_validator

from pagedserve.replicas.core.sampling_params import ParamError, StructuredOutputsParams
from pagedserve.serve_app import tool_calls
from pagedserve.serve_app.protocol.common import (
    _Request, _Response, SamplingFields, Usage, random_id,
)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs (ingress)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # under a reasoning parser: False drops reasoning_content

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message requires add_generation_prompt to be false")
        return self

    def tool_spec(self) -> tool_calls.ToolSpec | None:
        """The checked tools and tool_choice (ParamError naming the field)."""
        return tool_calls.tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """response_format / structured_outputs, or the grammar of a required or named tool call."""
        constraint = super().structured_outputs_params()
        spec = self.tool_spec()
        forced = tool_calls.tool_constraint(spec) if spec is not None else None
        if forced is not None and constraint is not None:
            raise ParamError("tool_choice", f"tool_choice {spec.mode!r} cannot be combined with "
                             f"{constraint.source}")
        return forced or constraint

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (vLLM's field)
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class _DropNone(_Response):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # OpenAI sends {"content": "..."} and a final {}
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
