"""Bounds on everything a request can make the server do, checked where a request enters.

A request must never be able to make the server slow for everyone: each list, string and count a
client controls has a limit (a setting), and going past one is a 400 naming the field before any
work is queued. Bodies are bounded in bytes by the HTTP layer (413, `pagedserve.serve_app.http`); prompts in
tokens by the model's context (`pipeline.generate_request`), and in characters before they are
tokenized, so a megabyte of text is refused without spending the tokenizer on it.
"""
from __future__ import annotations

from pydantic import BaseModel, Field

from pagedserve.serve_app import errors

# A prompt of more characters than this many per token of context cannot fit (no tokenizer we
# know of averages 32 characters per token), so it is refused before tokenization.
MAX_CHARS_PER_TOKEN = 32


class RequestLimits(BaseModel):
    """The limits, with their defaults; ServeSettings inherits these fields (one place for each)."""

    max_request_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_prompts_per_request: int = Field(128, ge=1)  # a completion's prompt list
    max_n: int = Field(128, ge=1)
    max_stop_strings: int = Field(16, ge=0)
    max_stop_string_chars: int = Field(256, ge=1)
    max_stop_token_ids: int = Field(256, ge=0)
    max_logit_bias_entries: int = Field(1024, ge=0)
    max_messages: int = Field(1024, ge=1)
    # Characters of prompt text in one request (a chat's messages together). None: the model's
    # context length times MAX_CHARS_PER_TOKEN.
    max_prompt_chars: int | None = Field(None, ge=1)

    def prompt_chars_limit(self, max_model_len: int) -> int:
        return self.max_prompt_chars or MAX_CHARS_PER_TOKEN * max_model_len


def _at_most(value: int, limit: int, param: str, what: str) -> None:
    if value > limit:
        raise errors.bad_request(f"{param} has {value} {what}; at most {limit} are allowed", param,
                                 code="limit_exceeded")


def check_sampling(request, limits: RequestLimits) -> None:
    """The fields completions and chat share (`pagedserve.serve_app.protocol.SamplingFields`)."""
    if request.n > limits.max_n:
        raise errors.bad_request(f"n must be at most {limits.max_n}, got {request.n}", "n",
                                 code="limit_exceeded")
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    _at_most(len(stops), limits.max_stop_strings, "stop", "strings")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise errors.bad_request(f"stop strings must be at most {limits.max_stop_string_chars} "
                                 f"characters, got one of {longest}", "stop", code="limit_exceeded")
    _at_most(len(request.stop_token_ids or ()), limits.max_stop_token_ids, "stop_token_ids",
             "token ids")
    _at_most(len(request.logit_bias or ()), limits.max_logit_bias_entries, "logit_bias", "entries")


def check_prompt_text(text: str, limits: RequestLimits, max_model_len: int,
                      param: str = "prompt") -> None:
    chars_limit = limits.prompt_chars_limit(max_model_len)
    if len(text) > chars_limit:
        raise errors.bad_request(f"{param} has {len(text)} characters; at most {chars_limit} are "
                                 f"allowed", param, code="context_length_exceeded")


def check_messages(request, limits: RequestLimits, max_model_len: int) -> None:
    """A chat's (or a chat tokenize request's) messages: their number and characters together."""
    _at_most(len(request.messages), limits.max_messages, "messages", "messages")
    chars = sum(len(m.text()) for m in request.messages)
    chars_limit = limits.prompt_chars_limit(max_model_len)
    if chars > chars_limit:
        raise errors.bad_request(f"messages have {chars} characters together; at most "
                                 f"{chars_limit} are allowed", "messages",
                                 code="context_length_exceeded")


def check_completion(request, limits: RequestLimits, max_model_len: int) -> None:
    check_sampling(request, limits)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        _at_most(len(prompt), limits.max_prompts_per_request, "prompt", "prompts")
    for text in [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]:
        check_prompt_text(text, limits, max_model_len)


def check_chat(request, limits: RequestLimits, max_model_len: int) -> None:
    check_sampling(request, limits)
    check_messages(request, limits, max_model_len)
