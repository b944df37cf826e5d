"""One user request inside the engine: its n sequences, their detokenizers, its timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from replicas.detokenizer import IncrementalDetokenizer
from replicas.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)
    logprobs: list[list[PositionLogprobs]] = field(default_factory=list)  # per seq
    cumulative_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        return max(0, self.seqs[0].num_cached_tokens)

    def output(self) -> RequestOutput:
        params = self.sampling_params
        completions = []
        for i, seq in enumerate(self.seqs):
            detok = self.detokenizers[i]
            finished = seq.is_finished
            text = detok.visible_text(finished) if detok is not None else ""
            completions.append(CompletionOutput(
                index=i,
                text=text,
                token_ids=seq.output_token_ids,
                cumulative_logprob=self.cumulative_logprobs[i] if params.logprobs is not None else None,
                logprobs=list(self.logprobs[i]) if params.logprobs is not None else None,
                finish_reason=seq.status.value if finished else None,
                stop_reason=seq.stop_reason,
            ))
        metrics = {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                   "finish_time": self.finish_time,
                   "num_generated_tokens": sum(s.num_output_tokens for s in self.seqs)}
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=completions, finished=self.finished,
            prompt_logprobs=self.prompt_logprobs, num_cached_tokens=self.num_cached_tokens,
            metrics=metrics)
