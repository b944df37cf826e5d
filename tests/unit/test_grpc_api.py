"""The gRPC door's pure parts (status mapping, proto building, request translation, keys) and
the door itself in-process over a fake ingress: auth, streams, errors, cancellation, health,
reflection, the shared port."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import free_port
from pagedserve.serve_app import errors
from pagedserve.serve_app.api_keys import authorized, bearer_token, key_accepted
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.grpc_api import auth, schema, status, translation
from pagedserve.serve_app.grpc_api.server import GRPCDoor
from pagedserve.serve_app.limits import RequestLimits
from pagedserve.serve_app.protocol import (
    ChatCompletionRequest, ChatCompletionStreamResponse, ChatStreamChoice, CompletionChoice,
    CompletionRequest, CompletionStreamResponse, DeltaMessage, ModelCard, ModelList,
    PromptTokensDetails, Usage,
)

pb, services = schema.modules()
KEY = "sk-unit"


# -- status mapping --------------------------------------------------------------------------------
@pytest.mark.parametrize("http, code", [
    (400, grpc.StatusCode.INVALID_ARGUMENT), (401, grpc.StatusCode.UNAUTHENTICATED),
    (404, grpc.StatusCode.NOT_FOUND), (408, grpc.StatusCode.DEADLINE_EXCEEDED),
    (413, grpc.StatusCode.RESOURCE_EXHAUSTED), (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (503, grpc.StatusCode.UNAVAILABLE), (500, grpc.StatusCode.INTERNAL),
    (418, grpc.StatusCode.INTERNAL)])
def test_each_http_status_has_one_grpc_code(http, code):
    assert status.status_code(OpenAIError("x", http)) == code


def test_details_lead_with_the_field_and_retry_after_is_trailing_metadata():
    assert status.details(errors.bad_request("must be >= 0", "temperature")) == \
        "temperature: must be >= 0"
    assert status.details(errors.unauthorized()) == "Incorrect or missing API key."
    assert status.trailing_metadata(errors.overloaded(3)) == (("retry-after", "3"),)
    assert status.trailing_metadata(errors.bad_request("x")) == ()


def test_grpc_outcomes_count_as_http_statuses():
    assert [status.http_status(c) for c in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED,
                                            grpc.StatusCode.INVALID_ARGUMENT,
                                            grpc.StatusCode.UNKNOWN)] == [200, 499, 400, 500]


# -- the proto ---------------------------------------------------------------------------------
def test_modules_are_built_once_from_the_shipped_proto():
    assert schema.modules() is schema.modules()
    assert (schema.PROTO_DIR / schema.PROTO_FILE).is_file()
    (service,) = pb.DESCRIPTOR.services_by_name.values()
    assert service.full_name == schema.SERVICE_NAME
    assert [m.name for m in service.methods] == ["Generate", "Embed", "ListModels"]
    assert service.methods_by_name["Generate"].server_streaming
    assert hasattr(services, "GenerateStub") and hasattr(services, "add_GenerateServicer_to_server")


# -- request translation -----------------------------------------------------------------------
def test_a_prompt_is_a_streaming_completion_with_usage():
    request = translation.generate_request(pb.GenerateRequest(
        model="m", prompt="hi", max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=["x"],
        ignore_eos=True, stop_token_ids=[2]))
    assert isinstance(request, CompletionRequest)
    assert (request.model, request.prompt, request.max_tokens, request.temperature, request.top_k,
            request.seed, request.stop, request.ignore_eos, request.stop_token_ids) == \
        ("m", "hi", 7, 0.5, 3, 11, ["x"], True, [2])
    assert request.stream and request.include_usage
    assert request.top_p is None and request.n == 1  # unset: the OpenAI defaults


def test_messages_are_a_streaming_chat():
    request = translation.generate_request(pb.GenerateRequest(
        messages=[pb.ChatMessage(role="system", content="be brief"),
                  pb.ChatMessage(role="user", content="hello")], temperature=0))
    assert isinstance(request, ChatCompletionRequest)
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"),
                                                               ("user", "hello")]
    assert request.temperature == 0 and request.model is None and request.stream


@pytest.mark.parametrize("message, param", [
    (pb.GenerateRequest(prompt="x", temperature=-1), "temperature"),
    (pb.GenerateRequest(prompt="x", top_p=0), "top_p"),
    (pb.GenerateRequest(prompt="x", max_tokens=-1), "max_tokens"),
    (pb.GenerateRequest(prompt="x", n=0), "n"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="robot", content="x")]), "messages.0.role"),
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(prompt="x", messages=[pb.ChatMessage(role="user", content="y")]), "prompt"),
])
def test_a_bad_field_is_invalid_argument_naming_it(message, param):
    with pytest.raises(OpenAIError) as caught:
        translation.generate_request(message)
    assert caught.value.param == param
    assert status.status_code(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert status.details(caught.value).startswith(f"{param}: ")


def test_embed_errors_name_the_proto_field():
    request = translation.embedding_request(pb.EmbedRequest(inputs=["a", "b"], dimensions=4))
    assert request.input == ["a", "b"] and request.dimensions == 4
    with pytest.raises(OpenAIError) as caught:
        translation.embedding_request(pb.EmbedRequest(inputs=[]))
    assert caught.value.param == "inputs" and "'inputs'" in caught.value.message
    later = errors.renamed(errors.bad_request("too long", "input"), {"input": "inputs"})
    assert later.param == "inputs"


def test_chunks_become_messages_with_text_ends_and_usage():
    completion = CompletionStreamResponse(id="c", created=0, model="m", choices=[
        CompletionChoice(index=1, text="ab")])
    assert [(m.index, m.text, m.finish_reason) for m in
            translation.generate_responses(pb, completion)] == [(1, "ab", "")]
    role = ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[
        ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    assert translation.generate_responses(pb, role) == []
    end = ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[
        ChatStreamChoice(index=0, delta=DeltaMessage(), finish_reason="length")])
    assert [(m.text, m.finish_reason) for m in translation.generate_responses(pb, end)] == \
        [("", "length")]
    thought = ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[
        ChatStreamChoice(index=0, delta=DeltaMessage(reasoning_content="hmm"))])
    assert [(m.reasoning, m.text) for m in translation.generate_responses(pb, thought)] == \
        [("hmm", "")]
    usage = CompletionStreamResponse(id="c", created=0, model="m", choices=[], usage=Usage(
        prompt_tokens=3, completion_tokens=2, total_tokens=5,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=1)))
    (last,) = translation.generate_responses(pb, usage)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens,
            last.usage.cached_tokens, last.id) == (3, 2, 5, 1, "c")


# -- keys ----------------------------------------------------------------------------------------
def test_keys_come_from_bearer_or_x_api_key_and_compare_whole():
    assert bearer_token(b"Bearer abc ") == b"abc" and bearer_token(b"Basic abc") == b""
    assert auth.key_headers((("authorization", "Bearer k1"),)) == (b"Bearer k1", b"")
    assert auth.key_headers((("x-api-key", "k2"),)) == (b"", b"k2")
    assert auth.key_headers(()) == (b"", b"")
    # A stale bearer token beside an accepted x-api-key passes, as on HTTP.
    assert authorized(b"Bearer old", b"k2", [b"k1", b"k2"])
    assert not authorized(b"Bearer old", b"", [b"k1", b"k2"])
    assert key_accepted(b"k2", [b"k1", b"k2"]) and not key_accepted(b"k", [b"k1", b"k2"])
    assert not key_accepted(b"", [b"k1"])


# -- the door over a fake ingress -------------------------------------------------------------
class FakeIngress:
    """The typed methods the door calls; `completions` streams `num_chunks` one-word chunks
    (never awaiting: a cancellation reaches the door's own awaits, not the chunks')."""

    def __init__(self, num_chunks: int = 3, error: OpenAIError | None = None,
                 stream_error: OpenAIError | None = None):
        self.settings = SimpleNamespace(api_keys=[KEY], limits=RequestLimits())
        self.metrics = SimpleNamespace(record_status=lambda *a: self.counted.append(a[1:]))
        self.counted: list[tuple[str, int]] = []
        self.num_chunks, self.error, self.stream_error = num_chunks, error, stream_error
        self.closed = asyncio.Event()
        self.streams = []
        self.is_ready = True

    def model_name(self) -> str:
        return "fake"

    async def completions(self, request):
        if self.error is not None:
            raise self.error
        chunks = self._chunks(request)
        self.streams.append(chunks)  # held: only the door's aclose() can end it early
        return chunks

    async def _chunks(self, request):
        try:
            for i in range(self.num_chunks):
                yield CompletionStreamResponse(id="f", created=0, model="fake", choices=[
                    CompletionChoice(index=0, text=f"w{i} ")])
                if self.stream_error is not None:
                    raise self.stream_error
            yield CompletionStreamResponse(id="f", created=0, model="fake", choices=[],
                                           usage=Usage(prompt_tokens=1,
                                                       completion_tokens=self.num_chunks))
        finally:
            self.closed.set()

    chat = completions

    async def models(self):
        return ModelList(data=[ModelCard(id="fake", created=1, max_model_len=64)])

    async def embeddings(self, request):
        raise errors.bad_request("The model `fake` does not serve embeddings.", "model")

    async def health(self):
        return True, "ok"

    async def ready(self):
        return self.is_ready, "reason"


def serve(ingress: FakeIngress, check, port: int | None = None, door_id: str = "app"):
    """Run `check(channel)` against a door over `ingress` (a coroutine function)."""
    async def main():
        door = GRPCDoor(ingress, "127.0.0.1", port or free_port(), door_id)
        await door.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{door.port}") as channel:
                return await check(channel)
        finally:
            await door.stop(0)
    return asyncio.run(main())


AUTH = (("authorization", f"Bearer {KEY}"),)


def test_generate_streams_deltas_then_usage():
    ingress = FakeIngress()

    async def check(channel):
        stub = services.GenerateStub(channel)
        return [m async for m in stub.Generate(pb.GenerateRequest(prompt="x"), metadata=AUTH)]

    messages = serve(ingress, check)
    assert "".join(m.text for m in messages) == "w0 w1 w2 "
    assert messages[-1].usage.completion_tokens == 3
    assert ingress.counted == [("grpc_generate", 200)]


def test_a_missing_or_wrong_key_is_unauthenticated_and_counted():
    ingress = FakeIngress()

    async def check(channel):
        stub = services.GenerateStub(channel)
        codes = []
        for metadata in [(), (("authorization", "Bearer wrong"),), (("x-api-key", "wrong"),)]:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
            codes.append(caught.value.code())
        ok = await stub.ListModels(pb.ListModelsRequest(), metadata=(("x-api-key", KEY),))
        return codes, ok

    codes, ok = serve(ingress, check)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert [(m.id, m.max_model_len) for m in ok.models] == [("fake", 64)]
    assert ingress.counted == [("grpc_list_models", 401)] * 3 + [("grpc_list_models", 200)]


def test_ingress_errors_become_their_status_with_retry_after():
    ingress = FakeIngress(error=errors.overloaded(2))

    async def check(channel):
        stub = services.GenerateStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as full:
            async for _ in stub.Generate(pb.GenerateRequest(prompt="x"), metadata=AUTH):
                pass
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            async for _ in stub.Generate(pb.GenerateRequest(prompt="x", temperature=-1),
                                         metadata=AUTH):
                pass
        with pytest.raises(grpc.aio.AioRpcError) as embed:
            await stub.Embed(pb.EmbedRequest(inputs=["a"]), metadata=AUTH)
        return full.value, bad.value, embed.value

    full, bad, embed = serve(ingress, check)
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after", "2") in tuple(full.trailing_metadata())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.details().startswith("temperature: ")
    assert embed.code() == grpc.StatusCode.INVALID_ARGUMENT and embed.details().startswith("model: ")
    assert ingress.counted == [("grpc_generate", 429), ("grpc_generate", 400), ("grpc_embed", 400)]


def test_a_failure_after_the_stream_started_ends_it_with_its_status():
    ingress = FakeIngress(stream_error=errors.unavailable("the replica went away", 1))

    async def check(channel):
        call = services.GenerateStub(channel).Generate(pb.GenerateRequest(prompt="x"),
                                                       metadata=AUTH)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for message in call:
                received.append(message.text)
        return received, caught.value

    received, error = serve(ingress, check)
    assert received == ["w0 "]
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "the replica went away"
    assert ("retry-after", "1") in tuple(error.trailing_metadata())
    assert ingress.counted == [("grpc_generate", 503)]


def test_a_cancelled_stream_closes_the_ingress_chunks():
    ingress = FakeIngress(num_chunks=100_000)

    async def check(channel):
        call = services.GenerateStub(channel).Generate(pb.GenerateRequest(prompt="x"),
                                                       metadata=AUTH)
        first = await call.read()
        call.cancel()
        await asyncio.wait_for(ingress.closed.wait(), 5)
        for _ in range(100):  # the count is taken as the handler unwinds
            if ingress.counted:
                break
            await asyncio.sleep(0.01)
        return first

    assert serve(ingress, check).text == "w0 "
    assert ingress.counted == [("grpc_generate", 499)]


def test_health_follows_readiness_and_reflection_lists_the_services():
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )
    ingress = FakeIngress()

    async def check(channel):
        health = health_pb2_grpc.HealthStub(channel)
        statuses = [(await health.Check(health_pb2.HealthCheckRequest())).status]
        ingress.is_ready = False
        statuses.append((await health.Check(health_pb2.HealthCheckRequest(
            service=schema.SERVICE_NAME))).status)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="nope"))
        return statuses, unknown.value.code()

    statuses, unknown = serve(ingress, check)
    assert statuses == [health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING]
    assert unknown == grpc.StatusCode.NOT_FOUND

    port = free_port()

    async def reflect(_):
        def services_listed():  # the descriptor database is a blocking client
            with grpc.insecure_channel(f"127.0.0.1:{port}") as sync_channel:
                return set(ProtoReflectionDescriptorDatabase(sync_channel).get_services())
        return await asyncio.to_thread(services_listed)

    assert serve(FakeIngress(), reflect, port) == {
        schema.SERVICE_NAME, "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection"}


def test_replicas_of_one_application_share_the_port_and_no_one_else():
    port = free_port()

    async def main():
        first = GRPCDoor(FakeIngress(), "127.0.0.1", port, "app")
        await first.start()
        try:
            sibling = GRPCDoor(FakeIngress(), "127.0.0.1", port, "app")
            await sibling.start()
            await sibling.stop(0)
            stranger = GRPCDoor(FakeIngress(), "127.0.0.1", port, "other-app")
            with pytest.raises(RuntimeError, match="another pagedserve application"):
                await stranger.start()
        finally:
            await first.stop(0)

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 10


# -- settings ------------------------------------------------------------------------------------
def test_grpc_port_is_off_by_default_and_reaches_the_ingress_from_its_flag():
    from pagedserve.catalog import catalog
    from pagedserve.parser import build_parser, settings_args
    from pagedserve.serve_app.config import ServeSettings

    assert ServeSettings.from_args({}, env={}).ingress_settings().grpc_port is None
    settings = catalog()
    namespace, _ = build_parser(settings).parse_known_args(["serve", "m", "--grpc-port", "50051"])
    args = settings_args(namespace, settings)
    assert ServeSettings.from_args(args, env={}).ingress_settings().grpc_port == 50051
    with pytest.raises(ValueError, match="grpc_port"):
        ServeSettings.from_args({"grpc_port": 0}, env={})
