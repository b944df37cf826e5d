"""One user request inside the engine: its n sequences, their detokenizers, its timings."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from replicas.detokenizer import IncrementalDetokenizer
from replicas.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from replicas.sampling_params import RequestOutputKind, SamplingParams
from replicas.sequence import Sequence

# What a caller may pass as a prompt: text, token ids, or a dict of "prompt" / "prompt_token_ids"
# (with the router's "block_hashes" where the ingress has them).
PromptInput = str | list[int] | dict


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
    # Per seq, how much a DELTA output has handed out already: (chars, tokens, finished).
    sent: list[list] = field(default_factory=list)
    num_outputs: int = 0
    # Under structured outputs, the Future of its compiled grammar (replicas.structured).
    grammar: Future | None = None
    embedding: list[float] | None = None  # a pooling request's, once its prompt has been run

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        return max(0, self.seqs[0].num_cached_tokens)

    @property
    def wants_output(self) -> bool:
        """Whether a step that advanced this request should hand out an output now."""
        return self.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY or self.finished

    def output(self) -> RequestOutput:
        delta = self.sampling_params.output_kind is RequestOutputKind.DELTA
        if delta and not self.sent:
            self.sent = [[0, 0, False] for _ in self.seqs]
        want_logprobs = self.sampling_params.logprobs is not None
        completions = []
        for i, seq in enumerate(self.seqs):
            detok = self.detokenizers[i]
            finished = seq.is_finished
            text = detok.visible_text(finished) if detok is not None else ""
            logprobs = self.logprobs[i] if want_logprobs else None
            if delta:  # only the new part: the cost follows the tokens made, not the length
                sent = self.sent[i]
                if sent[2] or (len(text) <= sent[0] and seq.num_output_tokens <= sent[1]
                               and not finished):
                    continue  # nothing new for this completion
                text = text[sent[0]:]
                token_ids = seq.token_ids[seq.num_prompt_tokens + sent[1]:]
                logprobs = logprobs[sent[1]:] if logprobs is not None else None
                sent[0], sent[1], sent[2] = sent[0] + len(text), seq.num_output_tokens, finished
            else:
                token_ids = seq.output_token_ids
                logprobs = list(logprobs) if logprobs is not None else None
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=token_ids,
                cumulative_logprob=self.cumulative_logprobs[i] if want_logprobs else None,
                logprobs=logprobs,
                finish_reason=seq.status.value if finished else None,
                stop_reason=seq.stop_reason,
            ))
        first = self.num_outputs == 0
        self.num_outputs += 1
        finished = self.finished
        metrics = None
        if finished:
            metrics = {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                       "finish_time": self.finish_time,
                       "num_generated_tokens": sum(s.num_output_tokens for s in self.seqs)}
        keep_prompt = first or not delta
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt if keep_prompt else None,
            prompt_token_ids=self.prompt_token_ids if keep_prompt else [],
            outputs=completions, finished=finished,
            prompt_logprobs=self.prompt_logprobs if keep_prompt else None,
            num_cached_tokens=self.num_cached_tokens,
            num_prompt_tokens=len(self.prompt_token_ids), metrics=metrics,
            embedding=self.embedding if finished else None)
