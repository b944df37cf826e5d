"""Reasoning models' thinking: which tags delimit it, and whether an output starts inside it.

vLLM's `reasoning_parser` names a family; the engine uses it to hold a request's grammar back
until the thinking ends (structured output constrains the answer, never the thinking), and the
ingress to split the text into `reasoning_content` and `content`. Both read the facts here, so
the two never disagree about where the answer begins. No torch: the control plane imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReasoningParserName = Literal["qwen3", "deepseek_r1"]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str  # the tag that opens the thinking
    end: str  # the tag that ends it; the answer follows
    # Whether the model writes the start tag itself, as its first token (Qwen3), rather than
    # find it in the prompt (DeepSeek-R1's template opens the thinking and the model never does).
    model_opens: bool

    def thinking_at_start(self, prompt: list[int] | str, start: int | str, end: int | str) -> bool:
        """Whether the output starts inside the thinking: the prompt's last start tag comes after
        its last end tag (token ids or text alike); with neither, unless the model opens it."""
        last_start, last_end = _last_index(prompt, start), _last_index(prompt, end)
        if last_start < 0 and last_end < 0:
            return not self.model_opens
        return last_start > last_end


FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", model_opens=True),
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>", model_opens=False),
}


@dataclass(frozen=True, slots=True)
class ThinkingTokens:
    """A reasoning format's tags as the engine's tokenizer spells them: one token each."""

    format: ReasoningFormat
    start_id: int
    end_id: int

    @classmethod
    def of(cls, name: str, tokenizer) -> ThinkingTokens:
        fmt = reasoning_format(name)
        ids = []
        for tag in (fmt.start, fmt.end):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"reasoning_parser {name!r} needs {tag!r} to be one token of the "
                                 f"tokenizer; it encodes to {len(encoded)}")
            ids.append(encoded[0])
        return cls(fmt, *ids)

    def thinking_at_start(self, prompt_token_ids: list[int]) -> bool:
        return self.format.thinking_at_start(prompt_token_ids, self.start_id, self.end_id)


def reasoning_format(name: str) -> ReasoningFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser {name!r} is not one of {sorted(FORMATS)}") from None


def _last_index(seq, item) -> int:
    if isinstance(seq, str):
        return seq.rfind(item)
    for i in range(len(seq) - 1, -1, -1):
        if seq[i] == item:
            return i
    return -1
