"""The Ingress deployment: validate, tokenize, hash, send to an engine replica, shape the answer.

Its typed methods (`models`, `completions`, `chat`, `embeddings`, `tokenize`, `detokenize`,
`load_lora_adapter`, `unload_lora_adapter`, `health`; the Responses API's `responses`,
`retrieve_response` and `delete_response`; Anthropic's `messages` and `count_message_tokens`) serve the HTTP routes (`pagedserve.serve_app.http`), the gRPC service
(`pagedserve.serve_app.grpc_api`, where grpc_port is set) and Ray handles from other jobs:

    handle = serve.get_app_handle("pagedserve")
    response = await handle.chat.remote({"messages": [...], "max_tokens": 16})
    async for chunk in handle.options(stream=True).chat.remote({..., "stream": True}): ...

A streaming call returns an async iterator of chunk objects; it is created only after the first
output arrived, so a bad request or a full queue raises `OpenAIError` instead of starting a stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import pickle
import time

from ray import serve

from pagedserve.replicas.engine import cpu_binding
from pagedserve.replicas.core.lora_request import LoRARequest
from pagedserve.replicas.core.pooling import pooling_params
from pagedserve.replicas.core.sampling_params import ParamError
from pagedserve.serve_app import embeddings, errors, formatters, limits
from pagedserve.serve_app import messages as anthropic_messages
from pagedserve.serve_app.adapters import AdapterRegistry
from pagedserve.serve_app.config import IngressSettings
from pagedserve.serve_app.engine_client import EngineClient
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.health import ReplicaHealth
from pagedserve.serve_app.metrics import IngressMetrics
from pagedserve.serve_app.prompts import (
    INLINE_TOKENIZE_CHARS, ModelInfo, chat_prompt, check_serves, completion_prompts,
    encode,
)
from pagedserve.serve_app.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
    LoadLoRAAdapterRequest, ModelCard, ModelList, TokenizeChatRequest, TokenizeCompletionRequest,
    TokenizeResponse, UnloadLoRAAdapterRequest, random_id,
)
from pagedserve.serve_app.protocol.messages import (
    CountTokensRequest, MessagesRequest, TokenCount,
)
from pagedserve.serve_app.protocol.responses import (
    DeletedResponse, ResponseObject, ResponsesRequest,
)
from pagedserve.serve_app.responses_api import ResponsesDoor
from pagedserve.serve_app.pipeline import RequestPipeline, generate_request
from pagedserve.serve_app.request_stream import merge_streams
from pagedserve.serve_app.routing.metrics import RoutingMetrics
from pagedserve.serve_app.routing.policy import RoutingSettings
from pagedserve.serve_app.stream_pacer import StreamPacer

logger = logging.getLogger(__name__)

REPLICA_DEPLOYMENT = "EngineReplica"
# Ray Serve's own drain of handle calls takes at least one of its wait loops of the drain budget.
SERVE_DRAIN_LOOP_S = 2.0


@serve.ingress()
class Ingress:
    """Front door of the application; one instance per ingress replica."""

    async def __init__(self, engine_replica, directory, settings: IngressSettings | dict,
                       response_store):
        """response_store: the ResponseStore deployment's handle (stored Responses)."""
        self.settings = IngressSettings.model_validate(settings)
        self.replica = engine_replica  # the control plane's calls: the model's facts, stats
        self.adapters = AdapterRegistry(directory, self.settings.lora_modules,
                                        self.settings.retry_after_s)
        self.replica_health = ReplicaHealth(REPLICA_DEPLOYMENT)
        self.drain_s = 0.0  # reconfigure() sets it, and the router's and the queue's settings
        self.engines = EngineClient(directory, RoutingSettings(), 0, self.settings.retry_after_s,
                                    RoutingMetrics(serve.get_replica_context().app_name,
                                                   REPLICA_DEPLOYMENT),
                                    self.replica_health.mark_dead,
                                    lambda: engine_replica.stats.remote(),
                                    self.adapters.update)
        self.engines.start()
        self.pacer = StreamPacer(self.settings.max_stream_events_per_s,
                                 self.settings.max_stream_delay_s)
        self._info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        self.metrics = IngressMetrics()
        self.pipeline = RequestPipeline(self.engines, self.pacer, self.metrics,
                                        self.settings.request_timeout_s)
        self.responses_door = ResponsesDoor(functools.partial(self.chat, sse=False),
                                            response_store, self.settings.retry_after_s)
        # Fetch the model's facts and tokenizer in the background: the first request then finds
        # them ready (a failure here is retried by the first request that needs them).
        self._prefetch = asyncio.get_running_loop().create_task(self._prefetch_model_info())
        self.front_door = None
        self._http_app = None
        if self.settings.http_port is not None:  # last: serve HTTP only once built
            from pagedserve.serve_app.front_door import HTTPFrontDoor, application_id
            self.front_door = HTTPFrontDoor(
                self.__serve_build_asgi_app__(), self.settings.http_host, self.settings.http_port,
                self.settings.max_ongoing_requests, self.settings.retry_after_s, application_id())
            await self.front_door.start()
        self.grpc_door = None
        if self.settings.grpc_port is not None:  # grpc is imported only where it is served
            from pagedserve.serve_app.front_door import application_id
            from pagedserve.serve_app.grpc_api.server import GRPCDoor
            self.grpc_door = GRPCDoor(self, self.settings.http_host, self.settings.grpc_port,
                                      application_id())
            await self.grpc_door.start()

    def reconfigure(self, config: dict) -> None:
        """Ray Serve's in-place update (`ServeSettings.ingress_user_config`): the router's
        settings, the admission queue's bound, scale from zero, the drain budget."""
        self.engines.configure_router(RoutingSettings(**config.get("routing", {})))
        self.engines.max_queued_requests = config["max_queued_requests"]
        self.engines.scale_from_zero = config["scale_from_zero"]
        self.drain_s = config["drain_s"]

    def model_name(self) -> str:
        return self._info.name if self._info is not None else ""

    def __serve_build_asgi_app__(self):
        """The HTTP app, built once: the front door and Ray Serve's proxy path share it."""
        if self._http_app is None:
            from pagedserve.serve_app.http import build_http_app
            self._http_app = build_http_app(self)
        return self._http_app

    async def __del__(self):
        """Ray Serve's shutdown, after its own drain of handle calls: drain the HTTP and gRPC
        servers (together), then close the connections to the cores."""
        grpc_door = getattr(self, "grpc_door", None)
        grpc_stopped = None
        if grpc_door is not None:
            from pagedserve.serve_app.front_door import END_STREAMS_S

            grpc_stopped = asyncio.ensure_future(
                grpc_door.stop(self.drain_s - SERVE_DRAIN_LOOP_S - END_STREAMS_S))
        front_door = getattr(self, "front_door", None)  # None: the constructor did not finish
        if front_door is not None:
            from pagedserve.serve_app.front_door import END_STREAMS_S

            left_s = self.drain_s - SERVE_DRAIN_LOOP_S
            await front_door.drain(left_s - END_STREAMS_S, lambda: self.engines.fail_all(
                errors.unavailable("the server is shutting down; retry the request",
                                   self.settings.retry_after_s)))
        if grpc_stopped is not None:
            await grpc_stopped
        engines = getattr(self, "engines", None)
        if engines is not None:
            engines.shutdown()

    # -- model -------------------------------------------------------------------------------
    async def model_info(self) -> ModelInfo:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        info = await self.replica.model_info.remote()
                    except Exception as exc:  # noqa: BLE001 - no replica is up (yet)
                        logger.debug("model info unavailable: %r", exc)
                        raise errors.unavailable("no engine replica is available",
                                                 self.settings.retry_after_s) from None
                    # Unpickling imports transformers (seconds): keep it off the event loop.
                    tokenizer = await asyncio.to_thread(pickle.loads, info["tokenizer"])
                    self._info = ModelInfo(
                        name=info["model_name"], max_model_len=info["max_model_len"],
                        block_size=info["block_size"], vocab_size=info["vocab_size"],
                        max_logprobs=info["max_logprobs"], tokenizer=tokenizer,
                        created=int(time.time()), tasks=tuple(info["tasks"]),
                        pooling=info.get("pooling"),
                        reasoning_parser=info.get("reasoning_parser"))
        return self._info

    async def _prefetch_model_info(self) -> None:
        try:
            await self.model_info()
        except Exception:  # noqa: BLE001
            logger.warning("could not fetch model info yet; the first request will retry",
                           exc_info=True)

    async def models(self) -> ModelList:
        info = await self.model_info()
        adapters = await self.adapters.listed()
        return ModelList(data=[
            ModelCard(id=info.name, created=info.created, root=info.name,
                      max_model_len=info.max_model_len),
            *(ModelCard(id=name, created=info.created, root=lora.lora_path, parent=info.name,
                        max_model_len=info.max_model_len)
              for name, lora in sorted(adapters.items()))])

    async def _checked_model(self, model: str | None) -> ModelInfo:
        return (await self._resolve(model))[0]

    async def _resolve(self, model: str | None) -> tuple[ModelInfo, LoRARequest | None]:
        """The model's facts, and the LoRA adapter `model` names (None: the base model); under
        an adapter the facts carry its name, which answers and metrics show."""
        info = await self.model_info()
        if not model or model == info.name:
            return info, None
        lora = (await self.adapters.listed()).get(model)
        if lora is None:
            raise errors.model_not_found(model)
        return dataclasses.replace(info, name=lora.lora_name), lora

    # -- LoRA adapters -------------------------------------------------------------------------
    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest | dict) -> str:
        """vLLM's runtime load: checked by an engine core, then served by every ingress replica
        under its name (`AdapterRegistry.load`)."""
        request = _parse(LoadLoRAAdapterRequest, request)
        self._check_runtime_lora()
        if request.lora_name == (await self.model_info()).name:
            raise errors.bad_request(f"{request.lora_name!r} is the base model's name", "lora_name")
        lora = await self.adapters.load(self.engines, request.lora_name, request.lora_path)
        logger.info("LoRA adapter %r loaded (id %d)", lora.lora_name, lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest | dict) -> str:
        """vLLM's runtime unload: new requests for it get 404; those in flight finish."""
        request = _parse(UnloadLoRAAdapterRequest, request)
        self._check_runtime_lora()
        await self.adapters.unload(self.engines, request.lora_name)
        logger.info("LoRA adapter %r unloaded", request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def _check_runtime_lora(self) -> None:
        if not self.settings.allow_runtime_lora_updating:
            raise OpenAIError("loading and unloading LoRA adapters at run time is off "
                              "(allow_runtime_lora_updating)", 404, code="not_found")

    # -- completions ---------------------------------------------------------------------------
    async def completions(self, request: CompletionRequest | dict, sse: bool = False):
        """A CompletionResponse, or (request.stream) an async iterator of CompletionStreamResponse
        (`sse`: the HTTP route's, some chunks already rendered as server-sent events)."""
        deadline = self.pipeline.deadline()
        request = _parse(CompletionRequest, request)
        info, lora = await self._resolve(request.model)
        check_serves(info, "generate")
        limits.check_completion(request, self.settings.limits, info.max_model_len)
        prompts = await completion_prompts(request, info)
        if request.logprobs is not None and request.logprobs > info.max_logprobs:
            raise errors.bad_request(f"logprobs must be at most {info.max_logprobs}", "logprobs")
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        request_id = random_id("cmpl")
        started = time.monotonic()
        generate = [generate_request(f"{request_id}-{i}" if len(prompts) > 1 else request_id,
                                     p, request, request.max_tokens, request.logprobs,
                                     prompt_logprobs, info, "prompt", lora)
                    for i, p in enumerate(prompts)]
        streams = await self.pipeline.start(generate, info.tokenizer, deadline)
        formatter = formatters.CompletionFormatter(request, info, request_id, prompts, sse)
        merged = merge_streams(streams)
        if request.stream:
            return self.pipeline.observed(formatter.stream(merged), formatter, info, started,
                                          streams, deadline)
        return await self.pipeline.collected(formatter, merged, info, started, streams, deadline)

    # -- chat ----------------------------------------------------------------------------------
    async def chat(self, request: ChatCompletionRequest | dict, sse: bool = False):
        """A ChatCompletionResponse, or (request.stream) an async iterator of chunks (`sse`: as
        for `completions`)."""
        deadline = self.pipeline.deadline()
        request = _parse(ChatCompletionRequest, request)
        info, lora = await self._resolve(request.model)
        check_serves(info, "generate")
        limits.check_chat(request, self.settings.limits, info.max_model_len)
        tools = _tool_spec(request)
        prompt = await chat_prompt(request, info, tools)
        num_top = request.top_logprobs or 0
        if num_top > info.max_logprobs:
            raise errors.bad_request(f"top_logprobs must be at most {info.max_logprobs}",
                                     "top_logprobs")
        request_id = random_id("chatcmpl")
        started = time.monotonic()
        generate = generate_request(request_id, prompt, request, request.max_output_tokens,
                                    num_top if request.logprobs else None, None, info,
                                    "messages", lora)
        streams = await self.pipeline.start([generate], info.tokenizer, deadline)
        formatter = formatters.ChatFormatter(request, info, request_id, sse, tools, prompt.text)
        merged = merge_streams(streams)
        if request.stream:
            return self.pipeline.observed(formatter.stream(merged), formatter, info, started,
                                          streams, deadline)
        return await self.pipeline.collected(formatter, merged, info, started, streams, deadline)

    # -- Responses -----------------------------------------------------------------------------
    async def responses(self, request: ResponsesRequest | dict, sse: bool = False):
        """OpenAI's Responses API on the chat pipeline (`pagedserve.serve_app.responses_api`): a
        ResponseObject, or (request.stream) an async iterator of its events (dicts; `sse`: as
        server-sent events)."""
        return await self.responses_door.create(_parse(ResponsesRequest, request), sse)

    async def retrieve_response(self, response_id: str) -> ResponseObject:
        return await self.responses_door.retrieve(response_id)

    async def delete_response(self, response_id: str) -> DeletedResponse:
        return await self.responses_door.delete(response_id)

    # -- Anthropic messages --------------------------------------------------------------------
    async def messages(self, request: MessagesRequest | dict, sse: bool = False):
        """Anthropic's Messages API on the chat pipeline (`pagedserve.serve_app.messages`): a
        MessagesResponse, or (request.stream) an async iterator of its stream events (`sse`: as
        server-sent events, a failure after the start as an error event)."""
        request = _parse(MessagesRequest, request)
        try:
            result = await self.chat(anthropic_messages.chat_request(request))
        except OpenAIError as exc:
            raise errors.renamed(exc, anthropic_messages.RENAMED_PARAMS) from None
        if not request.stream:
            return anthropic_messages.message_response(result)
        events = anthropic_messages.message_events(result)
        return anthropic_messages.sse_events(events) if sse else events

    async def count_message_tokens(self, request: CountTokensRequest | dict) -> TokenCount:
        """The prompt's length in tokens, as `messages` would template and tokenize it."""
        chat_request = anthropic_messages.chat_request(_parse(CountTokensRequest, request))
        info = await self._checked_model(chat_request.model)
        limits.check_messages(chat_request, self.settings.limits, info.max_model_len)
        prompt = await chat_prompt(chat_request, info, _tool_spec(chat_request))
        return TokenCount(input_tokens=len(prompt.token_ids))

    # -- embeddings ----------------------------------------------------------------------------
    async def embeddings(self, request: embeddings.EmbeddingRequest | dict
                         ) -> embeddings.EmbeddingResponse:
        """OpenAI's embeddings: one vector per input, in order (float lists or base64)."""
        request = _parse(embeddings.EmbeddingRequest, request)
        info, lora = await self._resolve(request.model)
        check_serves(info, "embed")
        items = request.items()
        texts = [item for item in items if isinstance(item, str)]
        for text in texts:
            limits.check_prompt_text(text, self.settings.limits, info.max_model_len, param="input")
        tokenize = functools.partial(embeddings.tokenize_inputs, request, info.tokenizer,
                                     info.max_model_len, info.vocab_size)
        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            token_ids = tokenize()
        else:
            token_ids = await asyncio.to_thread(tokenize)
        started = time.monotonic()
        vectors = await self.engines.embed(random_id("embd"), token_ids,
                                           pooling_params(info.pooling or "last"), lora,
                                           info.block_size)
        response = embeddings.build_response(request, vectors, token_ids, info.name)
        self.metrics.record_request(info.name, started, None, response.usage.prompt_tokens, 0, 0)
        return response

    # -- tokenizer endpoints -------------------------------------------------------------------
    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest | dict
                       ) -> TokenizeResponse:
        if isinstance(request, dict):
            request = _parse(TokenizeChatRequest if "messages" in request else TokenizeCompletionRequest,
                             request)
        info = await self._checked_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            limits.check_messages(request, self.settings.limits, info.max_model_len)
            ids = (await chat_prompt(request, info)).token_ids
        else:
            limits.check_prompt_text(request.prompt, self.settings.limits, info.max_model_len)
            ids = await encode(info.tokenizer, request.prompt, request.add_special_tokens)
        strs = info.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest | dict) -> DetokenizeResponse:
        request = _parse(DetokenizeRequest, request)
        info = await self._checked_model(request.model)
        if any(t < 0 or t >= info.vocab_size for t in request.tokens):
            raise errors.bad_request(f"token ids must be in [0, {info.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=info.tokenizer.decode(request.tokens))

    # -- health --------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Ray Serve calls this periodically (and replaces the replica where it raises)."""
        cpu_binding.keep_off_engine_cpus()  # cores that came or went since (a scale change)

    async def health(self) -> tuple[bool, str]:
        """(healthy, reason): every engine replica running, none with a dead engine loop."""
        return await self.replica_health.check()

    async def ready(self) -> tuple[bool, str]:
        """(ready, reason): some engine replica generated a token within readiness_window_s."""
        return self.replica_health.ready(self.settings.readiness_window_s,
                                         self.engines.last_generation)


def _tool_spec(request: ChatCompletionRequest):
    """The request's checked tools and tool_choice; a 400 naming the field otherwise."""
    try:
        return request.tool_spec()
    except ParamError as exc:
        raise errors.bad_request(str(exc), exc.param) from None


def _parse(model_cls, request):
    if isinstance(request, model_cls):
        return request
    from pydantic import ValidationError
    try:
        return model_cls.model_validate(request)
    except ValidationError as exc:
        raise errors.from_validation_error(exc.errors()) from None
