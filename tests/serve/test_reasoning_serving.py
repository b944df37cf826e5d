"""A reasoning model served for real: its thinking arrives in `reasoning_content`, whole or
streamed, and never in `content` or a tool call's arguments; grammars constrain only the answer;
`chat_template_kwargs` reach the template; the Responses and Messages doors carry the thinking
as a reasoning item and a thinking block."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.serve.conftest import API_KEY, ENGINE_ARGS, deploy

MODEL = ENGINE_ARGS["served_model_name"]
END_ID = 385  # `</think>` in the tiny reasoning model's vocabulary
# This prompt's greedy thinking ends at its eighth token with a small push towards the end tag.
ASK = [{"role": "user", "content": "numbers 1 2 3"}]
PUSH = {"logit_bias": {str(END_ID): 1}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}},
          "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking_app(cluster, thinking_model_dir):
    """The tiny reasoning model under deepseek_r1's parser, one replica, through Serve's proxy."""
    from types import SimpleNamespace

    from ray import serve
    deploy(dict(model=thinking_model_dir, num_replicas=1, replica_num_cpus=0.5, api_keys=API_KEY,
                reasoning_parser="deepseek_r1", **ENGINE_ARGS), "thinking", "/thinking")
    yield SimpleNamespace(base_url=f"{cluster.base_url}/thinking", name="thinking")
    serve.delete("thinking")


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


def test_responses_carry_the_thinking_as_a_reasoning_item(client):
    ask = dict(model=MODEL, input="numbers 1 2 3", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**ask)
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
                                          messages=[{"role": "user", "content": "numbers 1 2 3"}])
    reasoning = [item for item in whole.output if item.type == "reasoning"]
    assert reasoning[0].content[0].text == chat.choices[0].message.reasoning_content
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning[0].content[0].text


def test_messages_carry_the_thinking_as_a_thinking_block(thinking_app, client):
    import anthropic
    ask = [{"role": "user", "content": "quick tokens"}]  # its thinking ends on its own, early
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=ask)
    messages = anthropic.Anthropic(base_url=thinking_app.base_url, api_key=API_KEY, max_retries=0)
    message = messages.messages.create(model=MODEL, max_tokens=24, messages=ask,
                                       extra_body={"temperature": 0})
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", chat.choices[0].message.reasoning_content)
    assert (text.type, text.text) == ("text", chat.choices[0].message.content)
