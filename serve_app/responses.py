"""From replica deltas to OpenAI objects: accumulating choices, usage, and logprobs formats."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.replicas.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedserve.serve_app.protocol import (
    ChoiceLogprobs, CompletionLogprobs, PromptTokensDetails, TokenLogprob, TopLogprob, Usage,
)


@dataclass
class ChoiceState:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class PromptState:
    """Everything received so far for one prompt (its n choices)."""

    n: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    choices: list[ChoiceState] = field(default_factory=list)
    ttft_s: float | None = None  # the engine's, from arrival to first token (on the last output)

    def __post_init__(self):
        self.choices = [ChoiceState() for _ in range(self.n)]

    def add(self, delta: RequestOutput) -> None:
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        for choice in delta.outputs:
            self.choices[choice.index].add(choice)
        metrics = delta.metrics
        if metrics and metrics.get("first_token_time") is not None:
            self.ttft_s = metrics["first_token_time"] - metrics["arrival_time"]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


def usage(prompts: list[PromptState]) -> Usage:
    num_prompt = sum(p.num_prompt_tokens for p in prompts)
    num_generated = sum(p.num_generated_tokens for p in prompts)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                 total_tokens=num_prompt + num_generated,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(p.num_cached_tokens for p in prompts)))


class LogprobFormatter:
    """OpenAI's two logprobs shapes from the engine's per-position {token_id: Logprob} dicts."""

    def __init__(self, tokenizer, num_top: int):
        self.tokenizer = tokenizer
        self.num_top = num_top

    def token_str(self, token_id: int, position: PositionLogprobs | None = None) -> str:
        entry = position.get(token_id) if position else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id])

    def _top(self, position: PositionLogprobs) -> list[tuple[int, float]]:
        ranked = sorted(position.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))
        return [(tid, lp.logprob) for tid, lp in ranked
                if lp.rank is not None and lp.rank <= self.num_top]

    def completion(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                   text_offset: int, out: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """Append `token_ids` (one position each; None = no logprob, e.g. the first prompt token)."""
        out = out or CompletionLogprobs()
        for token_id, position in zip(token_ids, positions):
            token = self.token_str(token_id, position)
            out.tokens.append(token)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            if position is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            sampled = position.get(token_id)
            out.token_logprobs.append(sampled.logprob if sampled is not None else None)
            top = {self.token_str(tid, position): lp for tid, lp in self._top(position)}
            if sampled is not None:
                top.setdefault(token, sampled.logprob)
            out.top_logprobs.append(top)
        return out

    def chat(self, token_ids: list[int], positions: list[PositionLogprobs]) -> ChoiceLogprobs:
        content = []
        for token_id, position in zip(token_ids, positions):
            token = self.token_str(token_id, position)
            sampled = position.get(token_id)
            content.append(TokenLogprob(
                token=token, logprob=sampled.logprob if sampled is not None else float("-inf"),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[TopLogprob(token=(s := self.token_str(tid, position)), logprob=lp,
                                         bytes=list(s.encode("utf-8")))
                              for tid, lp in self._top(position)]))
        return ChoiceLogprobs(content=content)
