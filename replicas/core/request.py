"""One user request inside the engine: its n sequences, their detokenizers, its timings."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedserve.replicas.core.detokenizer import IncrementalDetokenizer
from pagedserve.replicas.core.lora_request import LoRARequest
from pagedserve.replicas.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedserve.replicas.core.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.replicas.core.sequence import FINISHED, Sequence

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
    # Under structured outputs, the Future of its compiled grammar (pagedserve.replicas.structured).
    grammar: Future | None = None
    embedding: list[float] | None = None  # a pooling request's, once its prompt has been run
    lora: LoRARequest | None = None  # the adapter it runs with
    # While its adapter loads, the Future of the load (the engine's LoRAManager.load).
    adapter: Future | None = None
    holds_adapter: bool = False  # its adapter is in memory and held for it until it ends

    def waits_on(self) -> list[Future]:
        """What must be done before it can be scheduled: its grammar, its adapter."""
        return [f for f in (self.grammar, self.adapter) if f is not None]

    @property
    def finished(self) -> bool:
        for seq in self.seqs:
            if seq.status not in FINISHED:
                return False
        return True

    @property
    def num_cached_tokens(self) -> int:
        return max(0, self.seqs[0].num_cached_tokens)

    @property
    def wants_output(self) -> bool:
        """Whether a step that advanced this request should hand out an output now."""
        return self.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY or self.finished

    def output(self) -> RequestOutput:
        """What changed since the last output (DELTA), or everything so far; every step of a
        stream makes one for each of its requests, so this reads each sequence's state once."""
        params = self.sampling_params
        delta = params.output_kind is RequestOutputKind.DELTA
        sent_all = self.sent
        if delta and not sent_all:
            sent_all = self.sent = [[0, 0, False] for _ in self.seqs]
        want_logprobs = params.logprobs is not None
        completions = []
        finished = True  # every sequence
        for i, seq in enumerate(self.seqs):
            status = seq.status
            done = status in FINISHED
            finished = finished and done
            detok = self.detokenizers[i]
            text = detok.visible_text(done) if detok is not None else ""
            logprobs = self.logprobs[i] if want_logprobs else None
            token_ids = seq.token_ids
            num_prompt = seq.num_prompt_tokens
            if delta:  # only the new part: the cost follows the tokens made, not the length
                sent = sent_all[i]
                num_output = len(token_ids) - num_prompt
                if sent[2] or (len(text) <= sent[0] and num_output <= sent[1] and not done):
                    continue  # nothing new for this completion
                text = text[sent[0]:]
                token_ids = token_ids[num_prompt + sent[1]:]
                logprobs = logprobs[sent[1]:] if logprobs is not None else None
                sent[0], sent[1], sent[2] = sent[0] + len(text), num_output, done
            else:
                token_ids = seq.output_token_ids
                logprobs = list(logprobs) if logprobs is not None else None
            completions.append(CompletionOutput(
                i, text, token_ids, self.cumulative_logprobs[i] if want_logprobs else None,
                logprobs, status.value if done else None, seq.stop_reason))
        first = self.num_outputs == 0
        self.num_outputs += 1
        metrics = None
        if finished:
            metrics = {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                       "finish_time": self.finish_time,
                       "num_generated_tokens": sum(s.num_output_tokens for s in self.seqs)}
        keep_prompt = first or not delta
        return RequestOutput(self.request_id, self.prompt if keep_prompt else None,
                self.prompt_token_ids if keep_prompt else [], completions, finished,
                self.prompt_logprobs if keep_prompt else None, self.num_cached_tokens,
                len(self.prompt_token_ids), metrics, self.embedding if finished else None)
