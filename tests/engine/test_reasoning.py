"""A reasoning model's grammar constrains only the answer: its thinking runs free until the end
tag, the tokens before it are the unconstrained ones, and everything after parses."""
import json

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.replicas.core.reasoning import FORMATS, ThinkingTokens
from pagedserve.replicas.core.sampling_params import StructuredOutputsParams as Constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}},
          "required": ["a"], "additionalProperties": False}
PROMPT = "hello world"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("llama_thinking"))


@pytest.fixture(scope="module")
def tags(model_dir):
    from transformers import AutoTokenizer
    return ThinkingTokens.of("qwen3", AutoTokenizer.from_pretrained(model_dir))


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0, **kw)


def answer_after(token_ids: list[int], text: str, end_id: int) -> tuple[int, dict]:
    """The end tag's index among the output tokens, and the answer after it, validated."""
    at = token_ids.index(end_id)
    value = json.loads(text.split("</think>", 1)[1])
    jsonschema.validate(value, SCHEMA)
    return at, value


def test_tags_must_be_single_tokens(tiny_model_dir, tags):
    from transformers import AutoTokenizer
    assert (tags.start_id, tags.end_id) == (384, 385)
    with pytest.raises(ValueError, match="'<think>' to be one token"):
        ThinkingTokens.of("deepseek_r1", AutoTokenizer.from_pretrained(tiny_model_dir("llama")))
    with pytest.raises(ValueError, match="not one of"):
        ThinkingTokens.of("o1", AutoTokenizer.from_pretrained(tiny_model_dir("llama")))


def test_thinking_at_start_per_family(tags):
    s, e = tags.start_id, tags.end_id
    r1, qwen3 = (ThinkingTokens(FORMATS[n], s, e) for n in ("deepseek_r1", "qwen3"))
    assert r1.thinking_at_start([1, 2]) and not qwen3.thinking_at_start([1, 2])
    for family in (r1, qwen3):
        assert family.thinking_at_start([1, s, 2])  # the template opened it
        assert not family.thinking_at_start([1, s, 2, e, 3])  # closed: enable_thinking=False
        assert family.thinking_at_start([s, e, 1, s])  # an earlier turn's, then a new one


def test_deepseek_r1_grammar_waits_for_the_end_of_the_thinking(model_dir, tags):
    """The prompt opens the thinking (no tags in it): the constrained run's tokens equal the free
    run's up to and including `</think>`, then parse; without the parser JSON starts at once."""
    llm = LLM(model_dir, max_model_len=512, reasoning_parser="deepseek_r1")
    free = llm.generate([PROMPT], params())[0].outputs[0]
    gated = llm.generate([PROMPT], params(structured_outputs=Constraint(json=SCHEMA)))[0].outputs[0]
    at, _ = answer_after(gated.token_ids, gated.text, tags.end_id)
    assert at > 0 and gated.token_ids[:at + 1] == free.token_ids[:at + 1]
    plain = LLM(model_dir, max_model_len=512).generate(
        [PROMPT], params(structured_outputs=Constraint(json=SCHEMA)))[0].outputs[0]
    jsonschema.validate(json.loads(plain.text), SCHEMA)


def test_qwen3_may_open_its_thinking_with_the_first_token(model_dir, tags):
    """No tags in the prompt: the first token may be `<think>` besides what the grammar allows;
    taken, the grammar waits for `</think>`; not taken, the answer is constrained from the start."""
    llm = LLM(model_dir, max_model_len=512, reasoning_parser="qwen3")
    constraint = Constraint(json=SCHEMA)
    direct = llm.generate([PROMPT], params(structured_outputs=constraint,
                                           logit_bias={tags.start_id: -100.0}))[0].outputs[0]
    jsonschema.validate(json.loads(direct.text), SCHEMA)
    chosen = llm.generate([PROMPT], params(structured_outputs=constraint))[0].outputs[0]
    assert chosen.token_ids[0] == tags.start_id  # this model's own choice, allowed
    bias = {tags.start_id: 30.0, tags.end_id: 60.0}  # `</think>` is out of the grammar at first
    opened = llm.generate([PROMPT], params(structured_outputs=constraint, logit_bias=bias))[0]
    tokens = opened.outputs[0].token_ids
    assert tokens[:2] == [tags.start_id, tags.end_id]
    answer_after(tokens, opened.outputs[0].text, tags.end_id)


def test_a_prompt_that_closed_the_thinking_is_constrained_at_once(model_dir, tags):
    llm = LLM(model_dir, max_model_len=512, reasoning_parser="deepseek_r1")
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True,
        enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    out = llm.generate([prompt], params(structured_outputs=Constraint(json=SCHEMA)))[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_speculation_keeps_the_gated_tokens(model_dir, tags):
    """Drafts stop before `</think>` while thinking (the token after it needs the grammar)."""
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3}
    plain = LLM(model_dir, max_model_len=512, reasoning_parser="deepseek_r1")
    spec = LLM(model_dir, max_model_len=512, reasoning_parser="deepseek_r1",
               speculative_config=config)
    for bias in ({}, {tags.end_id: 1.0}):
        p = params(structured_outputs=Constraint(json=SCHEMA), logit_bias=bias or None)
        want = plain.generate([prompt], p)[0].outputs[0]
        got = spec.generate([prompt], p)[0].outputs[0]
        assert got.token_ids == want.token_ids
    assert spec.llm_engine.stats()["spec_decode_num_drafts"] > 0


def test_an_engine_refuses_a_parser_its_tokenizer_cannot_spell(tiny_model_dir):
    with pytest.raises(ValueError, match="reasoning_parser 'qwen3' needs"):
        LLM(str(tiny_model_dir("llama")), max_model_len=512, reasoning_parser="qwen3")
