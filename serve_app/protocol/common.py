"""What every OpenAI request and response shares: the base models (requests reject unknown
fields, as OpenAI does), the sampling fields of completions and chat with vLLM's extras, the
structured-output fields, and the usage block."""
from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.replicas.core.sampling_params import (
    ParamError, SamplingParams, StructuredOutputsParams,
)


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
    n: int = Field(1, ge=1)  # at most the max_n setting (pagedserve.serve_app.limits)
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


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # under a reasoning parser
