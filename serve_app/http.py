"""The HTTP surface: a FastAPI app built per ingress instance over its typed methods.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings, /tokenize,
/detokenize, the Responses API's /v1/responses (create; GET and DELETE by id), Anthropic's
/v1/messages and /v1/messages/count_tokens, /v1/load_lora_adapter and /v1/unload_lora_adapter
(under allow_runtime_lora_updating), /health (liveness), /health/ready (readiness: some engine
generated lately), /metrics, /version, /docs, /openapi.json. Streams are server-sent events ending in `data: [DONE]`;
a failure after a stream started is sent as an error event, then `data: [DONE]`. Anthropic's
routes answer in Anthropic's shapes instead (`pagedserve.serve_app.messages`): their errors, and
events that end without `[DONE]`.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.responses import JSONResponse, PlainTextResponse, Response

from pagedserve.serve_app import errors
from pagedserve.serve_app.api_keys import authorized
from pagedserve.serve_app.embeddings import EmbeddingRequest, EmbeddingResponse
from pagedserve.serve_app.errors import OpenAIError
from pagedserve.serve_app.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
    DetokenizeRequest, DetokenizeResponse, LoadLoRAAdapterRequest, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse, UnloadLoRAAdapterRequest,
)
from pagedserve.serve_app.protocol.messages import (
    CountTokensRequest, MessagesRequest, MessagesResponse, TokenCount,
)
from pagedserve.serve_app.protocol.responses import (
    DeletedResponse, ResponseObject, ResponsesRequest,
)
from pagedserve.serve_app.sse import CoalescingStreamingResponse

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
OPEN_PATHS = frozenset({"/health", "/health/ready", "/metrics", "/version", "/docs", "/docs/oauth2-redirect",
                        "/redoc", "/openapi.json"})
COUNTED_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                 "/v1/models": "models", "/tokenize": "tokenize", "/detokenize": "detokenize",
                 "/v1/embeddings": "embeddings", "/v1/load_lora_adapter": "load_lora_adapter",
                 "/v1/unload_lora_adapter": "unload_lora_adapter", "/v1/messages": "messages",
                 "/v1/responses": "responses"}


class FrontDoorMiddleware:
    """API keys, body size and request counting, as plain ASGI (no per-chunk cost on streams).

    `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) is required on every route
    but OPEN_PATHS when keys are set; the token is compared with every key in constant time. A
    body over `max_body_bytes` is a 413: at once when its Content-Length says so, else as soon as
    that many bytes have arrived (the rest is never read).
    """

    def __init__(self, app, api_keys: list[str], record_status, model_name, max_body_bytes: int):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.record_status = record_status
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        return authorized(headers.get(b"authorization", b""), headers.get(b"x-api-key", b""),
                          self.keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # under a route prefix, e.g. "/my-app/v1/models"
            path = path[len(root):] or "/"
        endpoint = COUNTED_PATHS.get(path, "other")
        status = [500]

        async def send_and_count(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.keys and path not in OPEN_PATHS and scope.get("method") != "OPTIONS" \
                    and not self._authorized(scope):
                await errors.unauthorized().to_response(path)(scope, receive, send_and_count)
                return
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                bounded = await self._bounded_body(scope, receive)
                if bounded is None:
                    await errors.body_too_large(self.max_body_bytes).to_response(path)(
                        scope, receive, send_and_count)
                    return
                receive = bounded
            await self.app(scope, receive, send_and_count)
        finally:
            if endpoint != "other":
                self.record_status(self.model_name(), endpoint, status[0])


    async def _bounded_body(self, scope, receive):
        """A `receive` replaying the whole body, or None when it is over the limit."""
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return None
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left: let the app see it
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                break
        if len(messages) > 1 and all(m["type"] == "http.request" for m in messages):
            body = b"".join(m.get("body", b"") for m in messages)
            messages = [{"type": "http.request", "body": body, "more_body": False}]
        replay = iter(messages)

        async def replay_receive():
            message = next(replay, None)
            return message if message is not None else await receive()
        return replay_receive


def _json(model) -> Response:
    return Response(content=model.model_dump_json(), media_type="application/json")


async def _sse(chunks: AsyncIterator) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:  # a str is a server-sent event already
            yield chunk if isinstance(chunk, str) else f"data: {chunk.model_dump_json()}\n\n"
    except OpenAIError as exc:
        yield exc.sse_event()
    except Exception as exc:  # noqa: BLE001 - a bug after the stream started: tell the client
        logger.exception("stream failed")
        yield errors.internal_error(exc).sse_event()
    yield "data: [DONE]\n\n"


def _event_stream(events: AsyncIterator[str]) -> Response:
    return CoalescingStreamingResponse(events, media_type="text/event-stream",
                                       headers={"Cache-Control": "no-cache",
                                                "X-Accel-Buffering": "no"})


def _result(result) -> Response:
    if isinstance(result, (CompletionResponse, ChatCompletionResponse)):
        return _json(result)
    return _event_stream(_sse(result))


def build_http_app(ingress) -> FastAPI:
    app = FastAPI(title="pagedserve", version=VERSION,
                  description="OpenAI-compatible LLM serving on Ray Serve.")
    errors.install_error_handlers(app)
    app.add_middleware(FrontDoorMiddleware, api_keys=ingress.settings.api_keys,
                       record_status=ingress.metrics.record_status, model_name=ingress.model_name,
                       max_body_bytes=ingress.settings.limits.max_request_body_bytes)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        return _json(await ingress.models())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def retrieve_model(model_id: str):
        for card in (await ingress.models()).data:
            if card.id == model_id:
                return _json(card)
        raise errors.model_not_found(model_id)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": {"text/event-stream": {}}}})
    async def create_completion(request: CompletionRequest):
        return _result(await ingress.completions(request, sse=True))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: {"content": {"text/event-stream": {}}}})
    async def create_chat_completion(request: ChatCompletionRequest):
        return _result(await ingress.chat(request, sse=True))

    @app.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def create_embedding(request: EmbeddingRequest):
        return _json(await ingress.embeddings(request))

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        return PlainTextResponse(await ingress.load_lora_adapter(request))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await ingress.unload_lora_adapter(request))

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(request: TokenizeRequest):
        return _json(await ingress.tokenize(request))

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(request: DetokenizeRequest):
        return _json(await ingress.detokenize(request))

    @app.post("/v1/responses", response_model=ResponseObject,
              responses={200: {"content": {"text/event-stream": {}}}})
    async def create_response(request: ResponsesRequest):
        result = await ingress.responses(request, sse=True)
        return _json(result) if isinstance(result, ResponseObject) else _event_stream(result)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def retrieve_response(response_id: str):
        return _json(await ingress.retrieve_response(response_id))

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
    async def delete_response(response_id: str):
        return _json(await ingress.delete_response(response_id))

    @app.post("/v1/messages", response_model=MessagesResponse,
              responses={200: {"content": {"text/event-stream": {}}}})
    async def create_message(request: MessagesRequest):
        result = await ingress.messages(request, sse=True)
        return _json(result) if isinstance(result, MessagesResponse) else _event_stream(result)

    @app.post("/v1/messages/count_tokens", response_model=TokenCount)
    async def count_message_tokens(request: CountTokensRequest):
        return _json(await ingress.count_message_tokens(request))

    @app.get("/health")
    async def health():
        healthy, reason = await ingress.health()
        if not healthy:
            return errors.unavailable(reason, ingress.settings.retry_after_s).to_response()
        return JSONResponse({"status": "ok", "detail": reason})

    @app.get("/health/ready")
    async def ready():
        is_ready, reason = await ingress.ready()
        if not is_ready:
            return errors.unavailable(reason, ingress.settings.retry_after_s).to_response()
        return JSONResponse({"status": "ready", "detail": reason})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        from pagedserve.serve_app.metrics import prometheus_text
        return PlainTextResponse(await prometheus_text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    return app
