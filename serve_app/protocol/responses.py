"""/v1/responses: OpenAI's Responses API request, its output items and the response object.

The request accepts every field OpenAI's SDK and the Agents SDK send. What this server cannot do
(background mode, server-side conversations, prompt templates, built-in tools, non-text input)
is refused by name in `serve_app/response_items.py`; settings that only steer OpenAI's own
service or its built-in tools (`reasoning`, `truncation`, `max_tool_calls`, `service_tier`,
`prompt_cache_*`, `safety_identifier`) are accepted and change nothing here. Output items carry the
shapes the SDK's stream accumulator checks (ids that stay the same from `added` to `done`).
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_validator

from pagedserve.serve_app.protocol.common import _Request, _Response, random_id


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    # Sampling fields are checked once, by the chat request they become (errors keep these names).
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # effort and summary: the model decides how it thinks
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    context_management: Any = None
    # Accepted so the SDK's requests parse, then refused by name if set.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # vLLM extras, as on chat
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    priority: int = 0
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_input(self):
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        return self


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(_Response):
    id: str = Field(default_factory=lambda: random_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Response):
    id: str = Field(default_factory=lambda: random_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallItem(_Response):
    id: str = Field(default_factory=lambda: random_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseObject(_Response):
    id: str = Field(default_factory=lambda: random_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "completed"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = True
    metadata: dict[str, str] | None = None
    background: bool = False
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    user: str | None = None


class DeletedResponse(_Response):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
