"""/v1/messages: Anthropic's Messages request, its response, and its stream events.

Requests reject unknown fields, but accept every field Anthropic's SDK sends for a client-side
conversation: those that steer Anthropic's service (`thinking`, `service_tier`, `cache_control`,
`inference_geo`, `speed`, a block's `citations` or `caller`) are taken and ignored. Content
blocks of a kind this server does not read (images, documents, server tools' results) parse as
`OtherBlock`, which the translation refuses with a 400 naming the block.
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from pagedserve.serve_app.protocol.common import _Request, _Response

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# -- request -------------------------------------------------------------------------------------
class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ThinkingBlock(_Request):
    """An earlier answer's reasoning, sent back by the client; not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class OtherBlock(_Request):
    """A block kind this server does not read (image, document, ...): refused with a 400."""

    model_config = ConfigDict(extra="allow")
    type: str


def _as_blocks(value):
    """A string stands for one text block; as blocks, a bad block's error names the block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


_KNOWN_BLOCKS = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def _block_kind(value) -> str:
    """The union branch a block parses as. Branch names are bracketed, as pydantic names its
    own, so an error's path names the block's field (`messages.0.content.1.input`), not the
    branch as well."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"block[{kind if kind in _KNOWN_BLOCKS else 'other'}]"


def _branch(model, kind: str):
    return Annotated[model, Tag(f"block[{kind}]")]


ToolResultContent = Annotated[_branch(TextBlock, "text") | _branch(OtherBlock, "other"),
                              Discriminator(_block_kind)]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[ToolResultContent] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None

    _blocks = field_validator("content", mode="before")(_as_blocks)


ContentBlock = Annotated[
    _branch(TextBlock, "text") | _branch(ToolUseBlock, "tool_use")
    | _branch(ToolResultBlock, "tool_result") | _branch(ThinkingBlock, "thinking")
    | _branch(ThinkingBlock, "redacted_thinking") | _branch(OtherBlock, "other"),
    Discriminator(_block_kind)]


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    _blocks = field_validator("content", mode="before")(_as_blocks)


class Tool(_Request):
    """A client tool; Anthropic's server tools (web search, code execution, ...) are refused."""

    name: str = Field(min_length=1)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tools are not supported (type {kind!r}); define the tool "
                             f"with a name and an input_schema")
        return value


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice names a tool exactly when its type is 'tool'")
        return self


class OutputConfig(_Request):
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}
    effort: str | None = None  # accepted, ignored: the model decides how long it reasons


class CountTokensRequest(_Request):
    """What makes the prompt (/v1/messages/count_tokens takes just these); fields that steer
    Anthropic's service rather than a model served here are accepted and ignored."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None

    _blocks = field_validator("system", mode="before")(_as_blocks)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None


class TokenCount(_Response):
    input_tokens: int


# -- response ------------------------------------------------------------------------------------
class MessageUsage(_Response):
    """Anthropic's usage: `input_tokens` excludes what the prefix cache served, which
    `cache_read_input_tokens` counts (their sum is the prompt's length)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextOut(_Response):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(_Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing signs a local model's reasoning


ContentOut = TextOut | ToolUseOut | ThinkingOut


class MessagesResponse(_Response):
    id: str = Field(default_factory=message_id)
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


# -- stream events -------------------------------------------------------------------------------
class MessageStart(_Response):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class Ping(_Response):
    type: Literal["ping"] = "ping"


class ContentBlockStart(_Response):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentOut


class TextDelta(_Response):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(_Response):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(_Response):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDelta(_Response):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStop(_Response):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(_Response):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class OutputUsage(_Response):
    output_tokens: int


class MessageDelta(_Response):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: OutputUsage


class MessageStop(_Response):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop
               | MessageDelta | MessageStop)
