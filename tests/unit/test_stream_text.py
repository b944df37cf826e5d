"""The ingress's own text (serve_app/stream_text.py): a stream's outputs, however coalesced, read as
the engine's text, and a stop string ends a completion where the engine would have ended it."""
import copy
import itertools
import random

import pytest

from pagedserve.replicas.core.detokenizer import IncrementalDetokenizer
from pagedserve.replicas.core.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.replicas.core.sampling_params import (
    RequestOutputKind, SamplingParams, StructuredOutputsParams,
)
from pagedserve.serve_app.stream_text import StreamText, take_text
from tests.tiny_models import build_tiny_model, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_the_core_makes_no_text():
    for params in (SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, stop=["\n"]),
                   SamplingParams(max_tokens=4,
                                  structured_outputs=StructuredOutputsParams(regex="[ab]+"))):
        take_text(params)
        assert not params.detokenize


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


# ---- stop strings on a tokenizer made by hand ------------------------------------------------

PIECES = ["<eos>", "x", "a", "b", "c", "abc"]
EOS, X, A, B, C, ABC = range(len(PIECES))


@pytest.fixture(scope="module")
def pieces():
    """One token per piece, decoded by joining them: each token's text is known exactly."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(PIECES)}, unk_token="<eos>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _out(*completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [], list(completions), finished=finished)


def _c(ids: list[int], index: int = 0, finish: str | None = None, **kw) -> CompletionOutput:
    return CompletionOutput(index, "", ids, finish_reason=finish, **kw)


def test_a_partial_stop_string_is_held_back_then_released(pieces):
    text = StreamText(pieces, [], SamplingParams(max_tokens=20, stop=["abc"]))
    shown = []
    for output in (_out(_c([X, A, B])), _out(_c([X, X])),
                   _out(_c([X], finish="length"), finished=True)):
        assert not text.fill(output)
        shown.append(output.outputs[0].text)
    # "ab" could still become "abc" until the next text; all of it once the completion ends.
    assert shown == ["x", "ab", "xxx"]


@pytest.mark.parametrize("include", [False, True])
def test_a_held_back_partial_that_completes_is_never_streamed(pieces, include):
    text = StreamText(pieces, [], SamplingParams(max_tokens=20, stop=["abc"],
                                                 include_stop_str_in_output=include))
    first = _out(_c([X, A, B]))
    assert not text.fill(first)
    assert first.outputs[0].text == ("xab" if include else "x")  # included: nothing to retract
    second = _out(_c([C, X, X]))
    assert text.fill(second)  # the core runs on: the caller aborts it
    completion = second.outputs[0]
    assert second.finished and completion.text == ("c" if include else "")
    assert completion.token_ids == [C]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "abc")
    late = _out(_c([X]))  # sent before the core took the abort
    assert not text.fill(late) and late.outputs == [] and late.finished


def _lp(ids: list[int], values: list[float]) -> list[dict[int, Logprob]]:
    return [{token_id: Logprob(value, 1)} for token_id, value in zip(ids, values)]


def test_a_stop_string_inside_a_delta_cuts_its_tokens_and_logprobs(pieces):
    text = StreamText(pieces, [], SamplingParams(max_tokens=20, stop=["abc"], logprobs=0))
    first = _out(_c([X], logprobs=_lp([X], [-0.5]), cumulative_logprob=-0.5))
    text.fill(first)
    second = _out(_c([A, ABC, X], logprobs=_lp([A, ABC, X], [-1.0, -2.0, -4.0]),
                     cumulative_logprob=-7.5))
    assert text.fill(second)
    completion = second.outputs[0]
    assert first.outputs[0].text + completion.text == "xa"
    assert completion.token_ids == [A, ABC] and len(completion.logprobs) == 2
    assert completion.cumulative_logprob == -3.5
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "abc")


def test_n_completions_end_on_their_own(pieces):
    text = StreamText(pieces, [], SamplingParams(n=2, max_tokens=20, stop=["b"]))
    output = _out(_c([X, B, X]), _c([X], index=1))
    assert not text.fill(output) and not output.finished  # the second one runs on
    assert [(c.text, c.token_ids, c.finish_reason) for c in output.outputs] == [
        ("x", [X, B], "stop"), ("x", [X], None)]
    output = _out(_c([X]), _c([A], index=1))
    assert not text.fill(output) and [(c.index, c.text) for c in output.outputs] == [(1, "a")]
    output = _out(_c([X]), _c([X], index=1, finish="length"))
    assert text.fill(output) and output.finished  # the first one still runs in the core
    assert [(c.index, c.finish_reason) for c in output.outputs] == [(1, "length")]


@pytest.mark.parametrize("core_finished", [False, True])
def test_a_stop_string_completed_by_the_last_token_allowed(pieces, core_finished):
    """The engine checks the length first: the completion ends on "length", its text still cut."""
    text = StreamText(pieces, [], SamplingParams(max_tokens=3, stop=["ab"]))
    output = _out(_c([X, A, B], finish="length" if core_finished else None),
                  finished=core_finished)
    assert text.fill(output) == (not core_finished) and output.finished
    completion = output.outputs[0]
    assert completion.text == "x" and completion.token_ids == [X, A, B]
    assert (completion.finish_reason, completion.stop_reason) == (
        ("length", None) if core_finished else ("stop", "ab"))


def test_min_tokens_defers_stop_strings(pieces):
    text = StreamText(pieces, [], SamplingParams(max_tokens=20, stop=["a"], min_tokens=2))
    output = _out(_c([A, X, A, X]))
    assert text.fill(output)
    assert output.outputs[0].text == "ax" and output.outputs[0].token_ids == [A, X, A]


@pytest.mark.parametrize("grammar,ids,stop_reason,include,expected", [
    (False, [X, EOS], None, False, "x"),
    (False, [X, EOS], None, True, "x<eos>"),
    (False, [X, C], C, False, "x"),  # a stop token id
    (True, [X, C], None, False, "xc"),  # the grammar completed on "c": its text counts
    (True, [X, EOS], None, False, "x"),
    (True, [X, C], C, False, "x"),
])
def test_the_token_that_ended_a_completion(pieces, grammar, ids, stop_reason, include, expected):
    constraint = StructuredOutputsParams(choice=["xc"]) if grammar else None
    params = SamplingParams(max_tokens=20, skip_special_tokens=False,
                            include_stop_str_in_output=include, structured_outputs=constraint)
    output = _out(_c(ids, finish="stop", stop_reason=stop_reason), finished=True)
    assert not StreamText(pieces, [], params).fill(output)
    assert output.outputs[0].text == expected and output.outputs[0].token_ids == ids


# ---- against the engine: its own text, and the core's token ids through StreamText -----------

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
# How a stream may fold the core's one-token deltas: one each, pairs, pairs from the second,
# uneven, all at once.
GROUPINGS = [[1], [2], [1, 2], [3, 1, 5], [10**6]]
_request_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from pagedserve import LLM
    model_dir = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama",
                                 max_position_embeddings=256)
    return LLM(str(model_dir), max_model_len=256, enable_prefix_caching=False).llm_engine


def _run(engine, prompt: str, params: SamplingParams, kind) -> list[RequestOutput]:
    engine.add_request(f"r{next(_request_ids)}", prompt, params.clone(output_kind=kind))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def _core(engine, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    """What the core sends: no stop strings, no text, a delta a step."""
    return _run(engine, prompt, params.clone(stop=None, detokenize=False), DELTA)


def _texts(engine, core: list[RequestOutput],
           params: SamplingParams) -> list[tuple[str, list[int]]]:
    """Each completion's text without stop strings, and where each token's text ends in it."""
    ids: dict[int, list[int]] = {}
    for output in core:
        for c in output.outputs:
            ids.setdefault(c.index, []).extend(c.token_ids)
    texts = []
    for index in sorted(ids):
        detok = IncrementalDetokenizer(engine.tokenizer, core[0].prompt_token_ids,
                                       params.skip_special_tokens)
        ends = []
        for token_id in ids[index]:
            detok.append([token_id])
            ends.append(len(detok.text))
        texts.append((detok.text, ends))
    return texts


def _clean(s: str) -> bool:
    return "\ufffd" not in s and s.strip() == s and bool(s)


def _first_from(text: str, start: int, length: int = 3) -> str:
    """A substring first found at `start` or after, of readable characters."""
    for i in range(start, len(text) - length + 1):
        s = text[i:i + length]
        if _clean(s) and text.find(s) == i:
            return s
    raise AssertionError(f"no stop string to take from {text!r}")


def _coalesce(deltas: list[RequestOutput], sizes: list[int]) -> list[RequestOutput]:
    deltas, grouped, i = copy.deepcopy(deltas), [], 0
    for size in itertools.cycle(sizes):
        if i >= len(deltas):
            return grouped
        group, i = deltas[i:i + size], i + size
        for later in group[1:]:
            group[0].add(later)
        grouped.append(group[0])


def _stream(engine, params: SamplingParams, deltas: list[RequestOutput]):
    """The deltas through StreamText as the ingress hands them on, folded into one output; and
    the index of the delta after which fill() asked for an abort, if it did."""
    text = StreamText(engine.tokenizer, deltas[0].prompt_token_ids, params)
    total, aborted_at = None, None
    for i, output in enumerate(deltas):
        ran_on = not output.finished
        if text.fill(output):
            assert ran_on and aborted_at is None
            aborted_at = i
        if total is None:
            total = output
        else:
            total.add(output)
        if output.finished:
            break
    for late in deltas[i + 1:]:
        assert not text.fill(late) and late.outputs == [] and late.finished
    return total, aborted_at


def _check(engine, prompt: str, params: SamplingParams, core: list[RequestOutput]) -> RequestOutput:
    """The engine's own output for `params` equals the core's deltas through StreamText, however
    they are folded; returns the engine's."""
    reference = _run(engine, prompt, params, FINAL_ONLY)[-1]
    want = [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)
            for c in reference.outputs]
    ends_early = max(len(c.token_ids) for c in reference.outputs) < len(core)
    for sizes in GROUPINGS:
        got, aborted_at = _stream(engine, params, _coalesce(core, sizes))
        completions = sorted(got.outputs, key=lambda c: c.index)
        assert got.finished
        assert [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)
                for c in completions] == want, sizes
        for c, r in zip(completions, reference.outputs):
            if r.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
                assert c.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-4)
        if sizes == [1]:  # a delta a step: the ingress ended it before the core would have
            assert (aborted_at is not None) == ends_early
    return reference


GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("where", ["middle", "across_tokens", "last_token_allowed"])
def test_stop_strings_end_completions_as_in_the_engine(engine, where, include):
    prompt = "hello world"
    params = GREEDY.clone(include_stop_str_in_output=include)
    text, ends = _texts(engine, _core(engine, prompt, params), params)[0]
    if where == "middle":
        stop = _first_from(text, len(text) // 2)
    elif where == "across_tokens":  # its first character ends one token, its last starts the next
        b = next(ends[j] for j in range(5, len(ends) - 1)
                 if ends[j - 1] < ends[j] < ends[j + 1] and _clean(text[ends[j] - 1:ends[j] + 1])
                 and text.find(text[ends[j] - 1:ends[j] + 1]) == ends[j] - 1)
        stop = text[b - 1:b + 1]
    else:  # the token that completes it is the last one max_tokens allows
        j = next(j for j in range(len(ends) // 2, len(ends))
                 if ends[j - 1] < ends[j] and _clean(text[ends[j] - 2:ends[j]])
                 and text.find(text[ends[j] - 2:ends[j]]) == ends[j] - 2)
        stop = text[ends[j] - 2:ends[j]]
        params = params.clone(max_tokens=j + 1)
    params = params.clone(stop=[stop, "never in it"])
    reference = _check(engine, prompt, params, _core(engine, prompt, params))
    out = reference.outputs[0]
    cut = text.find(stop) + (len(stop) if include else 0)
    assert out.text == text[:cut]
    assert (out.finish_reason, out.stop_reason) == (
        ("length", None) if where == "last_token_allowed" else ("stop", stop))


def test_min_tokens_defers_stop_strings_as_in_the_engine(engine):
    prompt = "hello world"
    text, ends = _texts(engine, _core(engine, prompt, GREEDY), GREEDY)[0]
    # A stop string whose first occurrence lies within the first min_tokens tokens' text.
    for length, i in itertools.product((3, 2, 1), range(len(text))):
        stop = text[i:i + length]
        later = text.find(stop, i + length)
        if len(stop) == length and _clean(stop) and text.find(stop) == i and later != -1:
            min_tokens = next(t for t, end in enumerate(ends) if end >= i + length) + 1
            if ends[min_tokens - 1] <= later:
                break
    else:
        pytest.fail(f"no stop string occurs twice in {text!r}")
    params = GREEDY.clone(stop=[stop], min_tokens=min_tokens)
    out = _check(engine, prompt, params, _core(engine, prompt, params)).outputs[0]
    assert out.stop_reason == stop and len(out.text) > i


def test_n_completions_with_logprobs_as_in_the_engine(engine):
    prompt = "the quick brown fox"
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True,
                            logprobs=2)
    core = _core(engine, prompt, params)
    (text0, _), (text1, _) = _texts(engine, core, params)
    for stops in ([_first_from(text0, len(text0) // 3)],
                  [_first_from(text0, len(text0) // 3), _first_from(text1, len(text1) // 2)]):
        reference = _check(engine, prompt, params.clone(stop=stops), core)
        assert any(c.stop_reason in stops for c in reference.outputs)


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids_and_special_tokens_as_in_the_engine(engine, include):
    prompt = "paged attention"
    params = GREEDY.clone(skip_special_tokens=False, spaces_between_special_tokens=False,
                          include_stop_str_in_output=include)
    core = _core(engine, prompt, params)
    ids = [t for output in core for t in output.outputs[0].token_ids]
    # A stop token id with text of its own, first sampled halfway.
    k = next(k for k in range(10, len(ids)) if ids[k] not in ids[:k]
             and _clean(engine.tokenizer.decode([ids[k]]).strip()))
    params = params.clone(stop_token_ids=[ids[k]])
    core = _core(engine, prompt, params)
    _check(engine, prompt, params, core)  # no stop strings: the text alone
    text, _ = _texts(engine, core, params)[0]
    _check(engine, prompt, params.clone(stop=[_first_from(text, len(text) // 2, 2)]), core)


@pytest.mark.parametrize("include", [False, True])
def test_a_grammars_last_token_as_in_the_engine(engine, include):
    prompt = "hello"
    params = SamplingParams(temperature=0, max_tokens=20, skip_special_tokens=False,
                            include_stop_str_in_output=include,
                            structured_outputs=StructuredOutputsParams(
                                choice=["yes", "no", "maybe so"]))
    core = _core(engine, prompt, params)
    reference = _check(engine, prompt, params, core)
    text = reference.outputs[0].text
    assert text in ("yes", "no", "maybe so") and reference.outputs[0].finish_reason == "stop"
    # A stop string completed by the token that completed the grammar.
    reference = _check(engine, prompt, params.clone(stop=[text[-1]]), core)
    assert reference.outputs[0].stop_reason == text[-1]
