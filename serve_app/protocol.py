"""The wire protocol: OpenAI request/response objects, field for field, plus vLLM's extras.

Requests reject unknown fields (as OpenAI does) but accept every extra that vLLM accepts and load
generators send (`ignore_eos`, `repetition_penalty`, `top_k`, `min_p`, `min_tokens`,
`stream_options.continuous_usage_stats`, ...). The same models serve HTTP and Ray handles.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from replicas.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from serve_app import tool_calls


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


# -- shared request parts ------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class SamplingFields(_Request):
    """Sampling fields common to completions and chat (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1)  # at most the max_n setting (serve_app.limits)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    priority: int = 0  # under the engine's scheduling_policy=priority: lower is served first
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs
    # ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value):
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """vLLM's SamplingParams for this request; raises ValueError naming a bad field."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self.structured_outputs_params(),
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint asked for, if any; ParamError naming the field otherwise."""
        constraint = response_format_params(self.response_format)
        if self.structured_outputs is not None:
            if constraint is not None:
                raise ParamError("structured_outputs",
                                 "set structured_outputs or response_format, not both")
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.KINDS)
            if unknown:
                raise ParamError("structured_outputs", f"structured_outputs has unknown fields "
                                 f"{sorted(unknown)}; known: {', '.join(StructuredOutputsParams.KINDS)}")
            constraint = StructuredOutputsParams(**self.structured_outputs)
        return constraint

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def response_format_params(response_format: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format as a constraint: json_object, or json_schema's `schema`."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ParamError("response_format",
                             "response_format json_schema needs {'name': ..., 'schema': {...}}")
        return StructuredOutputsParams(json=spec["schema"], source="response_format")
    raise ParamError("response_format", f"response_format type must be text, json_object or "
                     f"json_schema, got {kind!r}")


# -- completions ---------------------------------------------------------------------------------
Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs (ingress)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if any(isinstance(p, list) and not p for p in value):
                raise ValueError("token-id prompts must not be empty")
        return value

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token that ended it


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- chat ----------------------------------------------------------------------------------------
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


# -- models, tokenize ----------------------------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
