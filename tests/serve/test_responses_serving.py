"""The Responses API served for real, through the `openai` SDK and the OpenAI Agents SDK
unchanged: whole and streamed responses (the deltas join to the final text, events in OpenAI's
order), structured output parsed into a pydantic model, function tools, a conversation chained
by previous_response_id, retrieve and delete, and errors naming the field (a reasoning model's
thinking as a reasoning item: tests/serve/test_reasoning_serving.py)."""
from __future__ import annotations

import json
from typing import Annotated

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import API_KEY, ENGINE_ARGS

MODEL = ENGINE_ARGS["served_model_name"]
ADD = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999},
                                        "b": {"type": "integer", "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
Small = Annotated[int, Field(ge=0, le=99)]  # bounded, so a random model's digits end
TOOLS = [{"type": "function", "name": "add", "description": "add two numbers", "parameters": ADD,
          "strict": True}]


def test_create_text_and_usage(client):
    response = client.responses.create(model=MODEL, input="hello world", max_output_tokens=8,
                                       temperature=0, instructions="be brief")
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "be brief" and response.model == MODEL


def test_stream_events_in_order_and_deltas_join_to_the_text(client):
    with client.responses.stream(model=MODEL, input="the quick brown fox", max_output_tokens=12,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = client.responses.create(model=MODEL, input="the quick brown fox",
                                    max_output_tokens=12, temperature=0)
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == 12 and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"


def test_parse_into_a_pydantic_model(client):
    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)

    parsed = client.responses.parse(model=MODEL, input="a person", text_format=Person,
                                    max_output_tokens=64, temperature=0)
    assert isinstance(parsed.output_parsed, Person)


def test_function_calls_and_their_outputs_continue_by_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="add 2 and 3", tools=TOOLS,
                                    tool_choice="required", max_output_tokens=64, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), ADD)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=4, temperature=0,
        tools=TOOLS, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # The same conversation sent whole gives the same answer.
    again = client.responses.create(
        model=MODEL, max_output_tokens=4, temperature=0, tools=TOOLS,
        input=[{"role": "user", "content": "add 2 and 3"},
               {"type": "function_call", "call_id": call.call_id, "name": "add",
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert again.output_text == second.output_text


def test_streamed_function_call_arguments(client):
    with client.responses.stream(model=MODEL, input="add", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "add"},
                                 max_output_tokens=64, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert call.type == "function_call" and deltas == call.arguments
    jsonschema.validate(json.loads(call.arguments), ADD)


def test_retrieve_and_delete(app, client):
    from ray import serve
    created = client.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    assert client.responses.retrieve(created.id).output_text == created.output_text
    # Stored outside the ingress replica that made it, for every ingress replica to find.
    blob = serve.get_deployment_handle("ResponseStore", app.name).get.remote(created.id).result()
    assert json.loads(blob)["response"]["id"] == created.id
    client.responses.delete(created.id)
    from openai import NotFoundError
    with pytest.raises(NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(NotFoundError):
        client.responses.create(model=MODEL, input="more", previous_response_id=created.id)
    unstored = client.responses.create(model=MODEL, input="hello", max_output_tokens=4,
                                       store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_ray_handle_gets_responses_and_events(app):
    from ray import serve
    handle = serve.get_app_handle(app.name)
    response = handle.responses.remote({"input": "hello", "max_output_tokens": 4,
                                        "store": False}).result()
    assert response.status in ("completed", "incomplete") and response.output[0].type == "message"
    events = handle.options(stream=True).responses.remote({"input": "hello", "stream": True,
                                                           "max_output_tokens": 4})
    kinds = [event["type"] for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "temperature": 9}, "temperature"),
    ({"input": "x", "previous_response_id": "resp-missing"}, "previous_response_id"),
])
def test_bad_input_names_the_field(http, body, param):
    response = http.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_the_agents_sdk_runs_a_tool_to_its_final_output(app):
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner,
                        function_tool)
    from openai import AsyncOpenAI

    calls = []

    @function_tool
    def add(a: Small, b: Small) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    client = AsyncOpenAI(base_url=f"{app.base_url}/v1", api_key=API_KEY, max_retries=0,
                         http_client=httpx.AsyncClient(timeout=60))
    # A random model would not end a free answer: the tool's result is the agent's final output.
    agent = Agent(name="adder", instructions="use the tool", tools=[add],
                  model=OpenAIResponsesModel(MODEL, client), tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", max_tokens=64,
                                               parallel_tool_calls=False,
                                               temperature=0))
    result = Runner.run_sync(agent, "add 2 and 3", run_config=RunConfig(tracing_disabled=True),
                             max_turns=3)
    assert len(calls) == 1 and result.final_output == str(sum(calls[0]))
