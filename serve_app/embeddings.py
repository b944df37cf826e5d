"""POST /v1/embeddings: OpenAI's request and response, input checks, float or base64 vectors.

Inputs are tokenized here (texts with the model's special tokens, as sentence-transformers does;
token ids as given) and checked once, so a replica receives only inputs it can embed.
`dimensions` keeps the first dimensions of each vector and normalizes them again (what OpenAI's
text-embedding-3 models do). `base64` is the little-endian float32 bytes of each vector, which
the OpenAI SDK decodes with numpy.
"""
from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from pagedserve.serve_app import errors
from pagedserve.serve_app.errors import OpenAIError

# OpenAI's limit on the number of inputs in one request.
MAX_EMBEDDING_INPUTS = 2048

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Texts = Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
TokenIdLists = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
EmbeddingInput = StrictStr | Texts | TokenIds | TokenIdLists


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value):
        texts = [value] if isinstance(value, str) else value
        if any(isinstance(t, str) and not t for t in texts):
            raise ValueError("input strings must be non-empty")
        return value

    def items(self) -> list[str | list[int]]:
        """The inputs as a list: texts or token-id lists."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def tokenize_inputs(request: EmbeddingRequest, tokenizer, max_model_len: int,
                    vocab_size: int) -> list[list[int]]:
    """Every input's token ids; a 400 naming `input` for one that is out of range or too long."""
    items = request.items()
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(tokenizer(texts)["input_ids"] if texts else [])
    token_ids = [next(encoded) if isinstance(item, str) else item for item in items]
    for i, ids in enumerate(token_ids):
        if len(ids) > max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens. However, input "
                f"{i} has {len(ids)} tokens. Please reduce the length of the input.", 400,
                param="input", code="context_length_exceeded")
        if not isinstance(items[i], str) and (min(ids) < 0 or max(ids) >= vocab_size):
            raise errors.bad_request(f"input token ids must be in [0, {vocab_size})", "input")
    return token_ids


def build_response(request: EmbeddingRequest, vectors: np.ndarray, token_ids: list[list[int]],
                   model_name: str) -> EmbeddingResponse:
    """vectors float32 [num_inputs, hidden] -> the response, in the request's format."""
    if request.dimensions is not None:
        if request.dimensions > vectors.shape[1]:
            raise errors.bad_request(f"dimensions must be at most {vectors.shape[1]} for this "
                                     "model", "dimensions")
        vectors = vectors[:, :request.dimensions]
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, np.float32(1e-12))
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    if request.encoding_format == "base64":
        encoded = [base64.b64encode(row.tobytes()).decode("ascii") for row in vectors]
    else:
        encoded = vectors.tolist()
    num_tokens = sum(len(ids) for ids in token_ids)
    return EmbeddingResponse.model_construct(
        data=[EmbeddingData.model_construct(index=i, embedding=e) for i, e in enumerate(encoded)],
        model=model_name, usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
