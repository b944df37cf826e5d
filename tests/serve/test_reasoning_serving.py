"""A reasoning model served for real: its thinking arrives in `reasoning_content`, whole or
streamed, and never in `content` or a tool call's arguments; grammars constrain only the answer;
`chat_template_kwargs` reach the template."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.serve.conftest import API_KEY, ENGINE_ARGS

MODEL = ENGINE_ARGS["served_model_name"]
END_ID = 385  # `</think>` in the tiny reasoning model's vocabulary
# This prompt's greedy thinking ends at its eighth token with a small push towards the end tag.
ASK = [{"role": "user", "content": "numbers 1 2 3"}]
PUSH = {"logit_bias": {str(END_ID): 1}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}},
          "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(thinking_app):
    from openai import OpenAI
    return OpenAI(base_url=f"{thinking_app.base_url}/v1", api_key=API_KEY, max_retries=0,
                  timeout=60)


@pytest.fixture(scope="module")
def offline(thinking_model_dir):
    from pagedserve import LLM, SamplingParams
    llm = LLM(thinking_model_dir, num_threads=1, reasoning_parser="deepseek_r1", **ENGINE_ARGS)

    def generate(messages, max_tokens, **kw) -> str:
        prompt = llm.get_tokenizer().apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    return generate


def test_thinking_and_answer_split_whole_and_streamed(client, offline):
    text = offline(ASK, 24, logit_bias={END_ID: 1})
    thinking, answer = text.split("</think>", 1)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24,
                                           temperature=0, extra_body=PUSH)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (thinking, answer)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24,
                                            temperature=0, stream=True, extra_body=PUSH)
    reasoning, content = [], []
    for chunk in stream:
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (thinking, answer)
    dropped = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24,
                                             temperature=0,
                                             extra_body={**PUSH, "include_reasoning": False})
    assert dropped.choices[0].message.reasoning_content is None
    assert dropped.choices[0].message.content == answer


def test_a_cut_off_thinking_is_all_reasoning(client, offline):
    text = offline(ASK, 4)
    message = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                             temperature=0).choices[0].message
    assert (message.reasoning_content, message.content) == (text, None)


def test_the_schema_constrains_the_answer_after_free_thinking(client, offline):
    thinking = offline(ASK, 24, logit_bias={END_ID: 1}).split("</think>", 1)[0]
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, temperature=0, stream=stream,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}},
            extra_body=PUSH)
        if stream:
            parts = [(getattr(c.choices[0].delta, "reasoning_content", None) or "",
                      c.choices[0].delta.content or "") for c in response if c.choices]
            reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
        else:
            reasoning = response.choices[0].message.reasoning_content
            content = response.choices[0].message.content
        assert reasoning == thinking  # the grammar left the thinking alone
        jsonschema.validate(json.loads(content), SCHEMA)


def test_tool_arguments_come_from_the_answer(client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}]
    response = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                              temperature=0, tools=tools, tool_choice="required",
                                              extra_body=PUSH)
    message = response.choices[0].message
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_chat_template_kwargs_close_the_thinking(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = response.choices[0].message
    assert message.reasoning_content is None
    assert isinstance(json.loads(message.content), dict)
