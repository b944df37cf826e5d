"""Structured outputs and tool calls through the real server: the OpenAI SDK (response_format,
structured_outputs, tools, streamed tool calls, a multi-turn conversation with tool results),
LangChain's ChatOpenAI.bind_tools, and 400s for bad constraints; on the default model, the SDK's
parse() into a pydantic model."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.serve.conftest import API_KEY, MODEL_NAME, deploy

ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "tags"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                       "tags": {"type": "array", "maxItems": 2,
                                "items": {"enum": ["new", "sale", "eco"]}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_response_format_and_structured_outputs(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=1,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "item", "schema": ITEM, "strict": True}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), ITEM)
    completion = client.completions.create(
        model=MODEL_NAME, prompt=["hello", "ray serve"], max_tokens=40, temperature=1.0, seed=2,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{3}"}})
    assert all(re.fullmatch("[a-z]{3}-[0-9]{3}", c.text) for c in completion.choices)
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in choice if c.choices) in ("sunny", "rainy")
    from ray import serve  # the same through the application handle
    handle = serve.get_app_handle("pagedserve")
    response = handle.completions.remote({"prompt": "hello", "max_tokens": 10, "structured_outputs": {
        "grammar": 'start: "a" | "b"'}}).result()
    assert response.choices[0].text in ("a", "b") and response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "a(b"}, "stream": True},
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: nothing_here"}},
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(http, path, body, param):
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": "hello"}
    response = http.post(path, json={"model": MODEL_NAME, "max_tokens": 8, **prompt, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_forced_tool_calls_and_their_stream(client):
    named = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=80, temperature=1.0,
        seed=3, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=80, temperature=1.0,
            seed=4, tool_choice=tool_choice, parallel_tool_calls=False, stream=True)
        calls, finish = {}, None
        for chunk in stream:
            choice = chunk.choices[0]
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                entry["name"] = delta.function.name or entry["name"]
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
        assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
        jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_multi_turn_with_tool_results_sdk_and_langchain(app, client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18 celsius"}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER],
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.tool_calls is None and answer.usage.prompt_tokens > \
        first.usage.prompt_tokens

    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL_NAME, base_url=f"{app.base_url}/v1", api_key=API_KEY,
                     max_tokens=60, temperature=0, max_retries=0)
    forced = llm.bind_tools([WEATHER], tool_choice="get_weather")
    reply = forced.invoke([HumanMessage("Weather in Oslo?")])
    (tool_call,) = reply.tool_calls
    assert tool_call["name"] == "get_weather"
    jsonschema.validate(tool_call["args"], WEATHER["function"]["parameters"])
    final = llm.bind_tools([WEATHER]).bind(max_tokens=8).invoke(
        [HumanMessage("Weather in Oslo?"), reply,
         ToolMessage("3 celsius", tool_call_id=tool_call["id"])])
    assert isinstance(final.content, str)


@pytest.mark.slow
def test_sdk_parse_into_a_pydantic_model_on_the_default_model(cluster):
    """Loads SmolLM2-135M-Instruct."""
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int = Field(ge=0, le=100)

    deploy(dict(num_replicas=1, replica_num_cpus=0.5, max_model_len=1024, num_kv_blocks=128),
           "default-structured", "/default")
    client = OpenAI(base_url=f"{cluster.base_url}/default/v1", api_key="none", max_retries=0,
                    timeout=120)
    model = client.models.list().data[0].id
    parsed = client.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=60, temperature=0)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    from ray import serve
    serve.delete("default-structured")
