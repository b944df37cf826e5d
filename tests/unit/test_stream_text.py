"""The ingress's own detokenizing (serve_app/stream_text.py): which requests it takes, and that a
stream's outputs, however coalesced, read as the engine's text."""
import random

import pytest

from replicas.detokenizer import IncrementalDetokenizer
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import SamplingParams, StructuredOutputsParams
from serve_app.stream_text import StreamText, take_text
from tests.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_takes_only_requests_whose_text_the_engine_does_not_need():
    plain = SamplingParams(max_tokens=4)
    assert take_text(plain) and not plain.detokenize
    for params in (SamplingParams(max_tokens=4, stop=["\n"]),
                   SamplingParams(max_tokens=4, stop="x"),
                   SamplingParams(max_tokens=4,
                                  structured_outputs=StructuredOutputsParams(regex="[ab]+"))):
        assert not take_text(params) and params.detokenize


def _deltas(output_ids: list[int], finish_reason: str, rng: random.Random) -> list[RequestOutput]:
    """A stream's outputs for one completion, several tokens in some (a coalesced delta)."""
    outputs, i = [], 0
    while i < len(output_ids):
        n = rng.choice([1, 1, 2, 5])
        last = i + n >= len(output_ids)
        outputs.append(RequestOutput("r", None, [], [CompletionOutput(
            0, "", output_ids[i:i + n], finish_reason=finish_reason if last else None)],
            finished=last))
        i += n
    return outputs


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
@pytest.mark.parametrize("finish_reason", ["length", "stop"])
def test_stream_text_is_the_engines_text(tokenizer, finish_reason, include_stop_str_in_output):
    rng = random.Random(0)
    prompt = tokenizer.encode("Say hello", add_special_tokens=False)
    for _ in range(30):
        ids = tokenizer.encode("日本 naïve 🙂 world, ok." * rng.randint(1, 3),
                               add_special_tokens=False)
        if finish_reason == "stop":
            ids.append(tokenizer.eos_token_id)
        params = SamplingParams(max_tokens=len(ids), skip_special_tokens=False,
                                include_stop_str_in_output=include_stop_str_in_output)
        engine = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False,
                                        include_stop_str_in_output=include_stop_str_in_output)
        for n, token_id in enumerate(ids):  # as the engine appends: a token a step
            engine.append([token_id], stop_terminated=finish_reason == "stop" and n == len(ids) - 1)
        text = StreamText(tokenizer, prompt, params)
        pieces = []
        for output in _deltas(ids, finish_reason, rng):
            text.fill(output)
            pieces.append(output.outputs[0].text)
        assert "".join(pieces) == engine.text
        assert engine.text.endswith("<|im_end|>") == (finish_reason == "stop"
                                                      and include_stop_str_in_output)


def test_each_completion_of_n_has_its_own_text(tokenizer):
    params = SamplingParams(n=2, max_tokens=8)
    text = StreamText(tokenizer, [], params)
    hello = tokenizer.encode("hello", add_special_tokens=False)
    world = tokenizer.encode(" world", add_special_tokens=False)
    output = RequestOutput("r", None, [], [CompletionOutput(1, "", world),
                                           CompletionOutput(0, "", hello)])
    text.fill(output)
    assert [c.text for c in output.outputs] == [" world", "hello"]
    later = RequestOutput("r", None, [], [CompletionOutput(0, "", world, finish_reason="length")])
    text.fill(later)
    assert later.outputs[0].text == " world"
