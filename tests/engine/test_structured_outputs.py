"""Structured outputs on a random-weight model (which would emit garbage unconstrained): every
output parses and validates, alone, batched with free requests (whose tokens do not change), and
across preemptions; bad constraints fail as ParamErrors and leave nothing allocated."""
import asyncio
import json
import os
import re
import time

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.engine.llm_engine import LLMEngine
from pagedserve.replicas.core.sampling_params import (
    ParamError, StructuredOutputsParams as Constraint,
)
from pagedserve.serve_app import tool_calls

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False,
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "scores": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "additionalProperties": False, "required": ["k", "v"],
            "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "maximum": 9,
                                                           "minimum": 0}}}},
    },
    "required": ["name", "age", "role", "tags", "address", "scores"],
    "additionalProperties": False,
}
PROMPTS = ["the quick brown fox", "hello world", "paged attention blocks", "ray serve"]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "additionalProperties": False,
                                      "required": ["a", "b"],
                                      "properties": {"a": {"type": "integer", "maximum": 999},
                                                     "b": {"type": "integer", "maximum": 999}}}}}]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), max_model_len=512)


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def check_free(llm):
    engine = llm.llm_engine
    assert not engine.requests and not engine.pending
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def constrained(kind, value, **kw):
    return SamplingParams(max_tokens=kw.pop("max_tokens", 300),
                          structured_outputs=Constraint(**{kind: value}), **kw)


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    params = [constrained("json", PERSON, temperature=0)] + \
             [constrained("json", PERSON, temperature=1.0, seed=s) for s in range(7)]
    outs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
    check_free(llm)


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[a-z]{2,6}-[0-9]{3}(\.[A-Z]{1,2})?"
    lark = 'start: "(" item (", " item){0,3} ")"\nitem: /[0-9]{1,3}/ | "x"'
    gbnf = 'root ::= "v" [0-9] ("." [0-9])?'
    outs = llm.generate(PROMPTS, [constrained("regex", regex, temperature=1.0, seed=1),
                                  constrained("choice", ["yes", "no", "maybe so"], temperature=0),
                                  constrained("grammar", lark, temperature=1.0, seed=2),
                                  constrained("grammar", gbnf, temperature=1.0, seed=3)],
                        use_tqdm=False)
    regex_text, choice_text, lark_text, gbnf_text = texts(outs)
    assert re.fullmatch(regex, regex_text)
    assert choice_text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\((?:[0-9]{1,3}|x)(?:, (?:[0-9]{1,3}|x)){0,3}\)", lark_text)
    assert re.fullmatch(r"v[0-9](\.[0-9])?", gbnf_text)
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    # json_object: any object; with n > 1 every sample is constrained on its own.
    out = llm.generate("hello", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=120,
                                               structured_outputs=Constraint(json_object=True)),
                       use_tqdm=False)[0]
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # free-form objects can run past max_tokens; what there is still follows the grammar
            assert c.text.startswith("{")


def test_free_requests_unchanged_by_constrained_ones_in_the_batch(llm):
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)]
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
                         [free[0], constrained("json", PERSON, temperature=0), free[1],
                          constrained("regex", "[0-9]{20}", temperature=0.7, seed=1)],
                         use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == \
        [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)
    assert re.fullmatch("[0-9]{20}", mixed[3].outputs[0].text)


def test_preemption_keeps_the_grammar_in_step(tiny_model_dir):
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "kind", "xs"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "kind": {"enum": ["alpha", "beta", "gamma"]},
                             "xs": {"type": "array", "maxItems": 8,
                                    "items": {"type": "integer", "minimum": 0, "maximum": 99}}}}
    params = [constrained("json", schema, temperature=1.0, seed=s, max_tokens=150)
              for s in range(6)]
    big = LLM(str(tiny_model_dir("llama")), max_model_len=512)
    reference = big.generate(PROMPTS + PROMPTS[:2], params, use_tqdm=False)
    # 12 blocks of 16 tokens for six growing sequences: they preempt each other.
    small = LLM(str(tiny_model_dir("llama")), max_model_len=192, num_kv_blocks=12, block_size=16)
    outs = small.generate(PROMPTS + PROMPTS[:2], params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    check_free(small)


def test_matcher_rolls_back_to_the_sequence_tokens(llm):
    engine = llm.llm_engine
    request = engine.make_request("rb", "hello", constrained("choice", ["abc", "abd"]))
    matcher = request.grammar.result().deep_copy()
    from pagedserve.replicas.structured import GrammarMatcher
    g = GrammarMatcher(matcher)
    ids = engine.tokenizer.encode("abc")
    assert g.advance([7] + ids, 1) and g.is_terminated
    assert g.advance([7] + ids[:1], 1) and not g.is_terminated and g.num_consumed == 1
    assert g.advance([7] + engine.tokenizer.encode("abd"), 1) and g.is_terminated


@pytest.mark.parametrize("kind,value,needle", [
    ("json", {"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
    ("json", '{"type": "object", ', "JSON"),
    ("json", {"type": "string", "pattern": "(unclosed"}, "regex"),
    ("json", {"type": "array", "uniqueItems": True}, "uniqueItems"),  # not supported
    ("regex", "a(b", "unclosed group"),
    ("grammar", "start: missing_rule", "missing_rule"),
    ("grammar", "root ::= (", ""),
])
def test_bad_constraints_are_param_errors_and_free_everything(llm, kind, value, needle):
    with pytest.raises(ParamError) as info:
        llm.generate(["hello", "world"], [SamplingParams(max_tokens=4),
                                          constrained(kind, value)], use_tqdm=False)
    assert info.value.param == "structured_outputs" and needle in str(info.value)
    check_free(llm)


def test_constraint_fields_are_checked():
    for bad in [dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice=[1]),
                dict(regex=""), dict(json=3), dict(json_object=False)]:
        with pytest.raises(ParamError) as info:
            SamplingParams(structured_outputs=Constraint(**bad))
        assert info.value.param == "structured_outputs"
    with pytest.raises(ParamError) as info:
        SamplingParams(structured_outputs=Constraint(regex="", source="response_format"))
    assert info.value.param == "response_format"


def test_compiled_grammars_are_cached(llm):
    compiler = llm.llm_engine.grammars
    before = compiler.num_compiled
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    llm.generate(PROMPTS, [constrained("json", schema, temperature=0)] * 2 +
                 [constrained("json", json.dumps(schema), temperature=0)] * 2, use_tqdm=False)
    assert compiler.num_compiled - before == 2  # the dict and its text are different specs


class GatedGrammars(LLMEngine):
    """Grammars compile only once the file GATE names exists: a compile that takes as long as
    the test wants."""

    GATE = None

    def __init__(self, config):
        super().__init__(config)
        real_compile = self.grammars._compile

        def gated(params):
            while not os.path.exists(GatedGrammars.GATE):
                time.sleep(0.01)
            return real_compile(params)
        self.grammars._compile = gated


def test_compiling_grammar_does_not_hold_up_the_engine(tiny_model_dir, tmp_path):
    from pagedserve.serve_app.errors import OpenAIError
    from tests.core_harness import generate, running_core

    GatedGrammars.GATE = str(tmp_path / "gate")
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=256)

    async def run():
        async with running_core(config, engine_class=f"{__name__}:GatedGrammars") as (core, client):
            prompt = core.tokenizer().encode("hello")
            slow = asyncio.ensure_future(generate(client, "slow", prompt, constrained(
                "regex", "[0-9]{4}", max_tokens=16)))
            fast = await generate(client, "fast", prompt, SamplingParams(temperature=0,
                                                                         max_tokens=8))
            assert len(fast.outputs[0].token_ids) == 8 or fast.outputs[0].finish_reason == "stop"
            gone = asyncio.ensure_future(generate(client, "gone", prompt, constrained(
                "regex", "[a-z]{9}", max_tokens=16)))
            await asyncio.sleep(0.3)
            assert not slow.done() and core.stats["num_waiting"] == 2
            gone.cancel()  # a client that leaves while its grammar compiles
            await asyncio.sleep(0.3)
            assert core.stats["num_waiting"] == 1
            open(GatedGrammars.GATE, "w").close()
            done = await slow
            assert re.fullmatch("[0-9]{4}", core.tokenizer().decode(done.outputs[0].token_ids))
            # A failing grammar reaches the caller as a 400 naming its field, and nothing stays.
            with pytest.raises(OpenAIError) as bad:
                await generate(client, "bad", prompt, constrained("regex", "((", max_tokens=16))
            assert bad.value.status_code == 400 and bad.value.param is not None
            await asyncio.sleep(0.3)
            assert core.stats["num_requests"] == 0

    asyncio.run(run())


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_always_validate(llm, choice):
    spec = tool_calls.tool_spec(
        WEATHER, {"type": "function", "function": {"name": "add"}} if choice == "named" else choice,
        False)  # one call: a weak model would otherwise append calls up to max_tokens
    params = SamplingParams(temperature=1.0, max_tokens=200,
                            structured_outputs=tool_calls.tool_constraint(spec))
    outs = llm.generate(PROMPTS, [params.clone(seed=s) for s in range(len(PROMPTS))],
                        use_tqdm=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        content, calls = tool_calls.parse_calls(out.outputs[0].text, spec)
        assert content is None and calls
        for call in calls:
            assert choice == "required" or call.name == "add"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("unpack_with_torch", [False, True])  # True: the accelerators' path
@pytest.mark.parametrize("vocab_size,rows,batch", [(100, [0, 1, 2], 3), (77, [1, 4], 6),
                                                   (384, [3], 4)])
def test_bitmask_masks_exactly_the_disallowed_tokens(vocab_size, rows, batch, unpack_with_torch):
    import torch

    from pagedserve.replicas.structured.bitmask import TokenBitmask

    class Prefilled:  # the words are set below: the unpacking is what is tested here
        def unsafe_compute_mask_ptr(self, *args):
            pass

    bitmask = TokenBitmask(4, vocab_size, torch.device("cpu"), unpack_with_torch)
    bitmask._executor = Prefilled()
    generator = torch.Generator().manual_seed(vocab_size)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), bitmask.num_words), dtype=torch.int32,
                          generator=generator)
    bitmask.host[:len(rows)] = words
    logits = torch.randn(batch, vocab_size, generator=generator)
    expected = logits.clone()
    for j, row in enumerate(rows):
        for token in range(vocab_size):
            if not (int(words[j, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    bitmask.apply(logits, rows, [None] * len(rows))
    assert torch.equal(logits, expected)
