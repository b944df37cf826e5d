"""Per-request sampling settings, vLLM-compatible names and normalisation."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


class ParamError(ValueError):
    """A request field that fails validation; `param` names it, for OpenAI's error `param`."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # crosses process boundaries intact
        return (ParamError, (self.param, str(self)))


class RequestOutputKind(enum.Enum):
    """What each output of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what changed since the previous output: streams
    FINAL_ONLY = 2  # one output, when the request finishes: non-streamed calls pay nothing per token


@dataclass
class StructuredOutputsParams:
    """vLLM's guided decoding request: exactly one of json (a JSON schema, dict or string),
    json_object (any JSON object), regex, choice (one of these strings), grammar (Lark, or GBNF).

    `source` names the request field it came from (`response_format` or `structured_outputs`),
    so an error in it names that field.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    source: str = field(default="structured_outputs", compare=False)

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one canonical string: with `kind`, the key of its compiled grammar."""
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    def verify(self) -> None:
        def fail(why: str):
            raise ParamError(self.source, f"{self.source} {why}")

        set_kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            fail(f"must set exactly one of {', '.join(self.KINDS)}; got {set_kinds or 'none'}")
        kind = set_kinds[0]
        value: Any = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    fail(f"json is not valid JSON: {exc}")
            if not isinstance(value, (dict, bool)):
                fail("json must be a JSON schema (an object)")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                fail(f"{kind} must be a non-empty string")
        elif kind == "choice":
            if (not isinstance(value, list) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                fail("choice must be a non-empty list of non-empty strings")
        elif value is not True:
            fail("json_object must be true")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # "last" or "mean": a prefill-only request whose final hidden states are pooled into its
    # output's `embedding` (replicas/core/pooling.py); it samples one token, which nobody reads.
    pooling: str | None = None
    # Filled by the engine, not the user.
    eos_token_ids: set[int] = field(default_factory=set, repr=False)  # the model's; set by the engine

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if self.temperature < _GREEDY_EPS:
            # Greedy ignores the truncation knobs, as in vLLM.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.verify()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def verify(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ParamError(name, f"{name} {why}")

        check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"must be in [-2, 2], got {self.frequency_penalty}")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
              f"must be in (0, 2], got {self.repetition_penalty}")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              f"must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        # The upper bound is the engine's max_logprobs: it checks them (LLMEngine.make_request).
        check(self.logprobs is None or self.logprobs >= 0, "logprobs",
              f"must be non-negative, got {self.logprobs}")
        check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
              f"must be non-negative, got {self.prompt_logprobs}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        if self.structured_outputs is not None:
            check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                  "must be a StructuredOutputsParams")
            self.structured_outputs.verify()

    def clone(self, **changes) -> "SamplingParams":
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "eos_token_ids"}
        fields.update(changes)
        return SamplingParams(**fields)
