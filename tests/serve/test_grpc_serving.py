"""The gRPC door of the running app, with a client built from the shipped .proto: greedy text equals
the HTTP route's, usage, structured output, models, errors as status codes, keys, cancellation,
health, reflection."""
from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.serve_app.grpc_api import schema
from tests.serve.conftest import (
    API_KEY, MODEL_NAME, generated_tokens, wait_for, wait_until_idle,
)

pb, services = schema.modules()
AUTH = (("authorization", f"Bearer {API_KEY}"),)
MESSAGES = [{"role": "system", "content": "you are a router"},
            {"role": "user", "content": "what is the capital of france"}]


@pytest.fixture(scope="module")
def channel(app):
    with grpc.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return services.GenerateStub(channel)


def generate(stub, **fields) -> list:
    return list(stub.Generate(pb.GenerateRequest(**fields), metadata=AUTH, timeout=60))


def error_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_a_prompt_streams_the_http_completion_text_then_usage(stub, http):
    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 12, "temperature": 0}
    expected = http.post("/v1/completions", json=body).json()
    messages = generate(stub, model=MODEL_NAME, prompt="hello world", max_tokens=12, temperature=0)
    assert len(messages) > 2, "streamed, not one message"
    assert "".join(m.text for m in messages) == expected["choices"][0]["text"]
    assert [m.finish_reason for m in messages if m.finish_reason] == \
        [expected["choices"][0]["finish_reason"]]
    usage = messages[-1].usage
    assert messages[-1].HasField("usage") and not any(m.HasField("usage") for m in messages[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        expected["usage"]["prompt_tokens"], expected["usage"]["completion_tokens"],
        expected["usage"]["total_tokens"])
    assert usage.cached_tokens <= usage.prompt_tokens
    assert all(m.id.startswith("cmpl-") for m in messages)


def test_messages_stream_the_http_chat_text(stub, http):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    expected = http.post("/v1/chat/completions", json=body).json()
    messages = generate(stub, messages=[pb.ChatMessage(**m) for m in MESSAGES], max_tokens=10,
                        temperature=0)
    assert "".join(m.text for m in messages) == expected["choices"][0]["message"]["content"]
    assert messages[-1].usage.completion_tokens == expected["usage"]["completion_tokens"]


def test_list_models(stub):
    (model,) = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=30).models
    assert (model.id, model.owned_by, model.max_model_len) == (MODEL_NAME, "pagedserve", 512)


def test_embed_on_a_generate_only_model_is_invalid_argument(stub):
    error = error_of(lambda: stub.Embed(pb.EmbedRequest(inputs=["hi"]), metadata=AUTH,
                                        timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("model: ") and "embeddings" in error.details()


def test_a_bad_or_missing_key_is_unauthenticated(stub):
    for metadata in [(), (("authorization", "Bearer sk-wrong"),), (("x-api-key", "sk-wrong"),)]:
        error = error_of(lambda: stub.ListModels(pb.ListModelsRequest(), metadata=metadata,
                                                 timeout=30))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.ListModels(pb.ListModelsRequest(), metadata=(("x-api-key", API_KEY),),
                           timeout=30).models


def test_a_bad_value_is_invalid_argument_naming_the_field(stub):
    error = error_of(lambda: generate(stub, prompt="hi", temperature=-1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("temperature: ")
    error = error_of(lambda: generate(stub, prompt="hi " * 600, max_tokens=4))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("prompt: ")


def test_a_json_schema_constrains_the_text(stub):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}},
              "required": ["a"], "additionalProperties": False}
    for fields in ({"prompt": "hello"}, {"messages": [pb.ChatMessage(role="user", content="hi")]}):
        messages = generate(stub, **fields, max_tokens=40, temperature=0,
                            json_schema=json.dumps(schema))
        jsonschema.validate(json.loads("".join(m.text for m in messages)), schema)
    error = error_of(lambda: generate(stub, prompt="hi", json_schema="{not json"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("json_schema: ")


def test_an_unknown_model_is_not_found(stub):
    error = error_of(lambda: generate(stub, model="no-such-model", prompt="hi"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in error.details()


def test_cancelling_a_stream_aborts_it_and_frees_its_blocks(app, stub):
    generated_before = generated_tokens(app.name, 2)
    call = stub.Generate(pb.GenerateRequest(prompt="hello world", max_tokens=400, ignore_eos=True,
                                            temperature=0), metadata=AUTH, timeout=60)
    assert next(call).text
    call.cancel()

    generated_after = wait_until_idle(app.name, 2)
    assert generated_after - generated_before < 400, "the request ran to the end: not aborted"


def test_health_check_is_serving_without_a_key(channel, stub):
    generate(stub, prompt="hi", max_tokens=2)  # ready: an engine generated lately
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", schema.SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )
    database = ProtoReflectionDescriptorDatabase(channel)
    assert set(database.get_services()) >= {schema.SERVICE_NAME, "grpc.health.v1.Health"}
    generate_rpc = database.FindFileContainingSymbol(schema.SERVICE_NAME)
    assert generate_rpc.package == "pagedserve.v1"


def test_rpcs_are_counted_under_their_endpoint_with_an_http_status(stub, http):
    generate(stub, prompt="hi", max_tokens=2)
    error_of(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=30))

    def counted():
        text = http.get("/metrics").text
        lines = [line for line in text.splitlines() if line.startswith("ray_pagedserve_requests")]
        return all(any(all(label in line for label in labels) for line in lines) for labels in (
            ('endpoint="grpc_generate"', 'status_code="200"'),
            ('endpoint="grpc_list_models"', 'status_code="401"')))

    wait_for(counted, 20, 0.5, "the RPCs in the request counter")
