"""/v1/completions: the request, its choices, the response and its stream chunks."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pagedserve.serve_app.protocol.common import _Response, SamplingFields, Usage, random_id


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
