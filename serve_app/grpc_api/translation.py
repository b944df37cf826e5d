"""Proto messages to the ingress's request models, and its answers back to proto messages.

A request is validated once, by the same pydantic models the HTTP routes use, so a bad field is
the same 400 (`OpenAIError` naming it) on every door; only the names that differ on the proto
(`inputs` for OpenAI's `input`) are renamed in the error.
"""
from __future__ import annotations

import json

from pydantic import ValidationError

from pagedserve.serve_app import errors
from pagedserve.serve_app.embeddings import EmbeddingRequest, EmbeddingResponse
from pagedserve.serve_app.protocol import (
    ChatCompletionRequest, ChatCompletionStreamResponse, CompletionRequest,
    CompletionStreamResponse, ModelList, Usage,
)

# GenerateRequest's optional scalars, named as the OpenAI fields they fill.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "min_p",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
EMBED_FIELD_NAMES = {"input": "inputs"}


def _validated(model_cls, fields: dict, proto_names: dict[str, str] | None = None):
    try:
        return model_cls.model_validate(fields)
    except ValidationError as exc:
        raise errors.renamed(errors.from_validation_error(exc.errors()), proto_names or {}) from None


def generate_request(message) -> CompletionRequest | ChatCompletionRequest:
    """A streaming completion (`prompt`) or chat (`messages`) request, usage on its last chunk."""
    fields: dict = {"stream": True, "stream_options": {"include_usage": True}}
    if message.model:
        fields["model"] = message.model
    for name in SAMPLING_FIELDS:
        if message.HasField(name):
            fields[name] = getattr(message, name)
    if message.stop:
        fields["stop"] = list(message.stop)
    if message.stop_token_ids:
        fields["stop_token_ids"] = list(message.stop_token_ids)
    if message.ignore_eos:
        fields["ignore_eos"] = True
    if message.HasField("json_schema"):
        try:
            schema = json.loads(message.json_schema)
        except ValueError as exc:
            raise errors.bad_request(f"json_schema is not JSON: {exc}", "json_schema") from None
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": schema}}
    has_prompt = message.HasField("prompt")
    if has_prompt == bool(message.messages):
        raise errors.bad_request("set exactly one of prompt and messages", "prompt")
    if has_prompt:
        return _validated(CompletionRequest, {**fields, "prompt": message.prompt})
    chat = [{"role": m.role, "content": m.content} for m in message.messages]
    return _validated(ChatCompletionRequest, {**fields, "messages": chat})


def embedding_request(message) -> EmbeddingRequest:
    fields: dict = {"input": list(message.inputs)}
    if message.model:
        fields["model"] = message.model
    if message.HasField("dimensions"):
        fields["dimensions"] = message.dimensions
    return _validated(EmbeddingRequest, fields, EMBED_FIELD_NAMES)


def usage_message(pb, usage: Usage):
    details = usage.prompt_tokens_details
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    total_tokens=usage.total_tokens,
                    cached_tokens=details.cached_tokens if details is not None else 0)


def generate_responses(pb, chunk: CompletionStreamResponse | ChatCompletionStreamResponse) -> list:
    """The messages one stream chunk becomes: one per choice with new text or an end (a chat's
    opening role chunk has neither), and the usage chunk's."""
    messages = []
    for choice in chunk.choices:
        if isinstance(chunk, CompletionStreamResponse):
            text, reasoning = choice.text, None
        else:
            text, reasoning = choice.delta.content, choice.delta.reasoning_content
        if text or reasoning or choice.finish_reason is not None:
            messages.append(pb.GenerateResponse(id=chunk.id, index=choice.index, text=text or "",
                                                reasoning=reasoning or "",
                                                finish_reason=choice.finish_reason or ""))
    if chunk.usage is not None and not chunk.choices:
        messages.append(pb.GenerateResponse(id=chunk.id, usage=usage_message(pb, chunk.usage)))
    return messages


def embed_response(pb, response: EmbeddingResponse):
    usage = response.usage
    return pb.EmbedResponse(
        model=response.model,
        embeddings=[pb.Embedding(values=item.embedding) for item in response.data],
        usage=pb.Usage(prompt_tokens=usage.prompt_tokens, total_tokens=usage.total_tokens))


def list_models_response(pb, models: ModelList):
    return pb.ListModelsResponse(models=[
        pb.Model(id=card.id, created=card.created, owned_by=card.owned_by, root=card.root or "",
                 parent=card.parent or "", max_model_len=card.max_model_len or 0)
        for card in models.data])
