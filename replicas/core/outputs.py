"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput.

With `RequestOutputKind.DELTA` each output carries only what changed since the previous one of
its request (new text, token ids, logprobs; only the completions that changed), and the prompt
(text, ids, logprobs) only in the first; `add` folds a later delta into an earlier one, so a
consumer that fell behind receives everything pending as one output.

They are msgspec Structs: the engine protocol (`replicas/engine/protocol.py`) carries them as they are,
positionally, and the offline `LLM` hands the same objects to its caller.
"""
from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct, array_like=True):
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One position: token id -> Logprob (the chosen token first, then the top-k).
PositionLogprobs = dict[int, Logprob]


class CompletionOutput(msgspec.Struct, array_like=True):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append a later delta of the same completion."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


class RequestOutput(msgspec.Struct, array_like=True):
    """Cumulative by default (vLLM's default); a delta under RequestOutputKind.DELTA."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_prompt_tokens: int = 0
    metrics: dict | None = None  # timings; on a request's last output
    embedding: list[float] | None = None  # a pooling request's pooled final hidden state

    def add(self, later: RequestOutput) -> None:
        """Fold a later delta of the same request into this one (vLLM's aggregate=True)."""
        by_index = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            mine = by_index.get(completion.index)
            if mine is None:
                self.outputs.append(completion)
                by_index[completion.index] = completion
            else:
                mine.add(completion)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.metrics is not None:
            self.metrics = later.metrics
        if later.embedding is not None:
            self.embedding = later.embedding
