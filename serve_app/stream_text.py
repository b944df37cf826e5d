"""Output text made in the ingress: the engine core sends token ids, each stream decodes them.

The engine core is the serving path's busiest process (it steps the model for every stream; on
an accelerator its time between steps is the device's idle time), and detokenizing was a tenth
of its time on a small model. As vLLM's API server does, the ingress makes the text of every
request and ends a completion on its stop strings; grammars (structured outputs) stay in the
core, in token space. The text is the engine's own: the same `IncrementalDetokenizer` over the
same tokenizer, run on each output the stream hands on, however many tokens it holds; a stop
string ends a completion where the engine would have ended it, and the caller then aborts the
request in the core, which holds its KV blocks until told.
"""
from __future__ import annotations

from pagedserve.replicas.core.detokenizer import IncrementalDetokenizer
from pagedserve.replicas.core.outputs import CompletionOutput, RequestOutput
from pagedserve.replicas.core.sampling_params import SamplingParams


def take_text(params: SamplingParams) -> None:
    """The core is told to make no text (`params.detokenize` off): the stream's `StreamText`
    makes it. The core then reads none of the text settings: stop, include_stop_str_in_output,
    skip_special_tokens, spaces_between_special_tokens (min_tokens it still reads, for eos)."""
    params.detokenize = False


class _Completion:
    """One completion as the stream knows it: its text, how much of that was handed on, its
    cumulative logprob as of its last output, whether it has ended."""

    __slots__ = ("detokenizer", "sent", "cumulative_logprob", "finished")

    def __init__(self, detokenizer: IncrementalDetokenizer):
        self.detokenizer = detokenizer
        self.sent = 0
        self.cumulative_logprob = 0.0
        self.finished = False


class StreamText:
    """The text of one request's completions, from the token ids of its delta outputs (or of its
    one final output), cut at its stop strings as the engine cuts them."""

    __slots__ = ("params", "finished", "_eos_token_ids", "_completions")

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.params = params
        self.finished = False  # every completion has ended
        # Only a grammar's "stop" needs them, to tell an eos id (its text left out) from the
        # token that completed the grammar: the model's where the caller filled them in (the
        # engine fills in only its own copy of params), else the tokenizer's.
        self._eos_token_ids = params.eos_token_ids or {getattr(tokenizer, "eos_token_id", None)}
        self._completions = [_Completion(IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens,
            params.spaces_between_special_tokens, params.stop, params.include_stop_str_in_output,
            params.min_tokens)) for _ in range(params.n)]

    def fill(self, output: RequestOutput) -> bool:
        """Set each completion's text to what its new token ids add, ending it where a stop
        string ends it (left out of later outputs from then on). Returns whether the caller must
        now abort the request in the core: every completion has ended, one on a stop string
        here, while the core runs on (the output then reads finished)."""
        if self.finished:  # what the core sent before it took the abort
            output.outputs, output.finished = [], True
            return False
        kept = []
        for completion in output.outputs:
            state = self._completions[completion.index]
            if not state.finished:
                self._fill(state, completion)
                kept.append(completion)
        output.outputs = kept
        if all(state.finished for state in self._completions):
            self.finished = True
            abort, output.finished = not output.finished, True
            return abort
        return False

    def _fill(self, state: _Completion, completion: CompletionOutput) -> None:
        detokenizer = state.detokenizer
        ids = completion.token_ids
        leave_out_last = self._ended_on_stop_token(completion)
        if detokenizer.stop:
            # A token at a time, as the engine appends them: the completion ends at the token
            # whose text completes a stop string.
            for i, token_id in enumerate(ids):
                detokenizer.append((token_id,), leave_out_last and i == len(ids) - 1)
                if detokenizer.stop_str is not None:
                    self._stop(state, completion, i + 1)
                    break
        else:
            detokenizer.append(ids, leave_out_last)
        if completion.cumulative_logprob is not None:
            state.cumulative_logprob = completion.cumulative_logprob
        state.finished = completion.finish_reason is not None
        text = detokenizer.visible_text(state.finished)
        completion.text = text[state.sent:]
        state.sent = len(text)

    def _stop(self, state: _Completion, completion: CompletionOutput, num_kept: int) -> None:
        """End the completion on its stop string after its first `num_kept` new tokens."""
        ids = completion.token_ids
        if num_kept == len(ids) and completion.finish_reason == "length":
            return  # the engine checks the length first: that token ended it, its text still cut
        completion.finish_reason, completion.stop_reason = "stop", state.detokenizer.stop_str
        if num_kept == len(ids):
            return
        completion.token_ids = ids[:num_kept]
        if completion.logprobs is not None:
            completion.logprobs = completion.logprobs[:num_kept]
            total = state.cumulative_logprob  # summed as the engine sums it, a token at a time
            for token_id, position in zip(completion.token_ids, completion.logprobs):
                total += position[token_id].logprob
            completion.cumulative_logprob = total

    def _ended_on_stop_token(self, completion: CompletionOutput) -> bool:
        """Whether the core ended the completion on an eos or stop token id, whose text is left
        out as the engine leaves it out. A grammar also ends one with "stop", on a token whose
        text counts; an eos id ends a sequence before its grammar sees it."""
        if completion.finish_reason != "stop":
            return False
        params = self.params
        if params.structured_outputs is None or isinstance(completion.stop_reason, int):
            return True
        ids = completion.token_ids
        return bool(ids) and not params.ignore_eos and ids[-1] in self._eos_token_ids
