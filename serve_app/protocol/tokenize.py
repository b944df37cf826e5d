"""/v1/models, /tokenize and /detokenize."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pagedserve.serve_app.protocol.chat import ChatMessage
from pagedserve.serve_app.protocol.common import _Request, _Response


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
