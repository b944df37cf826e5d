"""From a request to the token ids the engine gets: what the ingress knows of the model, the
prompts of a completion (strings or token ids), a chat through the model's template (tools
included), and tokenization that keeps long texts off the event loop."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pagedserve.serve_app import errors, tool_calls
from pagedserve.serve_app.protocol import (
    ChatCompletionRequest, CompletionRequest, TokenizeChatRequest,
)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    block_size: int
    vocab_size: int
    max_logprobs: int
    tokenizer: Any
    created: int
    tasks: tuple[str, ...] = ("generate",)  # what the model serves: "generate", "embed"
    pooling: str | None = None  # a decoder's pooling mode, where it embeds
    reasoning_parser: str | None = None  # a reasoning model's family (its thinking split off)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None


async def completion_prompts(request: CompletionRequest, info: ModelInfo) -> list[Prompt]:
    """One Prompt per prompt of the request (a string, token ids, or a list of either)."""
    prompt = request.prompt
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = await encode(info.tokenizer, item, request.add_special_tokens)
            prompts.append(Prompt(ids, item))
        else:
            if any(t < 0 or t >= info.vocab_size for t in item):
                raise errors.bad_request(f"prompt token ids must be in [0, {info.vocab_size})",
                                         "prompt")
            prompts.append(Prompt(list(item), None))
    return prompts


async def chat_prompt(request: ChatCompletionRequest | TokenizeChatRequest, info: ModelInfo,
                      tools: tool_calls.ToolSpec | None = None) -> Prompt:
    """The conversation rendered by the model's chat template, and its token ids."""
    messages = []
    for m in request.messages:
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    tokenizer = info.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise errors.bad_request("this model has no chat template; use /v1/completions")
    tool_list = request.tools if tools is not None and tools.mode != "none" else None
    messages = tool_calls.template_messages(messages, tool_list, tokenizer.chat_template)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tool_list, tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            **(request.chat_template_kwargs or {}))
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise errors.bad_request(f"the chat template rejected the messages: {exc}",
                                 "messages") from None
    ids = await encode(tokenizer, text, request.add_special_tokens)
    return Prompt(ids, text)


# Longer texts are tokenized in a worker thread (the Rust tokenizer releases the GIL), so one big
# prompt does not hold up every stream this ingress is sending.
INLINE_TOKENIZE_CHARS = 16384


async def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


def check_serves(info: ModelInfo, task: str) -> None:
    if task not in info.tasks:
        what = ("does not generate text: it is an embedding model (use /v1/embeddings)"
                if task == "generate" else "does not serve embeddings")
        raise errors.bad_request(f"The model `{info.name}` {what}.", "model",
                                 code="model_not_supported")
