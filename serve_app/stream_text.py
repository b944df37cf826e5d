"""Output text made in the ingress: the engine sends a request's token ids, its stream decodes them.

The engine core is the serving path's busiest process (it steps the model for every stream; on
an accelerator its time between steps is the device's idle time), and detokenizing was a tenth
of its time on a small model. As vLLM's API server does, the ingress turns token ids into text
for every request whose text the engine has no use for: one without stop strings (the engine
stops on those) and without structured output (whose grammar may end a sequence on a token whose
text counts). The text is the engine's own: the same `IncrementalDetokenizer` over the same
tokenizer, run on each output the stream hands on, however many tokens it holds.
"""
from __future__ import annotations

from replicas.detokenizer import IncrementalDetokenizer
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams


def take_text(params: SamplingParams) -> bool:
    """Whether the ingress decodes this request's text; if so the engine is told not to
    (`params.detokenize` off). The OpenAI routes never ask for token ids alone, so a request the
    ingress makes with `detokenize` off is one whose text it decodes."""
    if params.detokenize and not params.stop and params.structured_outputs is None:
        params.detokenize = False
        return True
    return False


class StreamText:
    """The text of one request's completions, from the token ids of its outputs."""

    __slots__ = ("tokenizer", "prompt_token_ids", "params", "_detokenizers")

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}

    def fill(self, output: RequestOutput) -> None:
        """Set each completion's text to what its new token ids add (its last id, an eos or stop
        token's, left out as the engine leaves it out)."""
        for completion in output.outputs:
            detokenizer = self._detokenizers.get(completion.index)
            if detokenizer is None:
                p = self.params
                detokenizer = self._detokenizers[completion.index] = IncrementalDetokenizer(
                    self.tokenizer, self.prompt_token_ids, p.skip_special_tokens,
                    p.spaces_between_special_tokens,
                    include_stop_str_in_output=p.include_stop_str_in_output)
            # Without stop strings or a grammar, "stop" means the last id is an eos / stop token.
            completion.text = detokenizer.append(completion.token_ids,
                                                 stop_terminated=completion.finish_reason == "stop")
